"""Assembling a daemon: engine, store, capture, signals, training and the app's lifespan.

Everything the routes in `api/` use is built here once from the settings and shut down in
reverse order; the lifespan also runs the background tasks (idle-session sweep, the sample
pipeline, the training loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from clawback.chat import ChatRenderer
from clawback.engine import Engine
from clawback.judge.backends import EngineBackend, JudgeBackend, OpenAIBackend
from clawback.records import Version
from clawback.trainer.priority import ServingGauge, available_cores, thread_budget

from .adapters import AdapterManager
from .api import AppState, create_app, resolve_api_key
from .capture import Capture
from .config import Settings
from .feedback import Hub
from .forget import forget
from .gate import CandidateGate
from .guard import LiveGuard
from .layout import RayPlacement
from .retirement import NoteRetirement
from .samples import SamplePipeline
from .store import ForgetScope, Store
from .training import RayTrainer, Trained, TrainerStarter, TrainingLoop

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def build_state(settings: Settings, start_trainer: TrainerStarter | None = None) -> AppState:
    """Load model, tokenizer, store: everything the routes and the background tasks need.

    `start_trainer` starts the trainer the training loop drives; by default a Ray actor placed by
    the [layout] table (the simulator passes one that runs in a thread of this process)."""
    from transformers import AutoTokenizer

    from ..engines import build_engine
    from .models import resolve_model

    train = settings.train.enabled
    # First: a layout the cluster cannot host fails before anything is built.
    placement = _ray_placement(settings) if train and start_trainer is None else None
    model_dir = resolve_model(settings.model, settings.models_dir, progress=log.info)
    engine_threads, trainer_threads = thread_budget(available_cores(), train, settings.torch_threads,
                                                    settings.train.threads)
    engine = build_engine(settings.engine_config(), model_dir, engine_threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    store = Store(settings.db_path, queue_size=settings.store_queue_size, memory_max_notes=settings.memory_max_notes)
    renderer, hub = ChatRenderer(tokenizer), Hub()
    judge_name, judge = _judge(settings, engine, renderer, tokenizer)
    pipeline = SamplePipeline(store, engine, renderer, judge, settings.signal_config(),
                              on_ready=lambda sample: hub.broadcast({"type": "sample_ready", **sample}))
    adapters = AdapterManager(
        engine, store, settings.data_dir / "adapters", settings.train.keep_versions,
        on_live=lambda v: hub.broadcast({"type": "adapter_live", "version": Version.name_of(v)}))
    gate = CandidateGate(engine, renderer, store, settings.gate, busy=lambda: state.running) \
        if settings.gate.enabled else None
    guard = LiveGuard(store, adapters, settings.gate, on_rollback=lambda r: hub.broadcast(
        {"type": "adapter_rolled_back", "version": r.version.name, "to": Version.name_of(r.to),
         "reason": r.reason})) if settings.gate.guard_replies else None
    trainer = gauge = None
    if train:
        gauge = ServingGauge(settings.data_dir / "serving")
        start = start_trainer or _ray_trainer(settings, model_dir, placement, trainer_threads, gauge)

        def on_trained(step: Trained) -> None:
            hub.broadcast({"type": "trained", "version": step.version.name, "samples": step.samples,
                           "mean_reward": step.mean_reward})

        retirement = NoteRetirement(engine, renderer, store, settings.memory_retire_margin,
                                    busy=lambda: state.running, placement=settings.memory_placement) if settings.memory and settings.memory_retire else None
        trainer = TrainingLoop(store, adapters, settings.train_config(), start, on_trained, gate=gate,
                               on_refused=lambda r: hub.broadcast({"type": "adapter_refused", "version": r.version.name,
                                                                   "reason": r.reason}),
                               retirement=retirement)
    capture = Capture(store, settings.session_idle_timeout_s, settings.session_cache_size)
    state = AppState(settings, engine, renderer, store, capture, resolve_api_key(settings), hub, pipeline, adapters,
                     trainer, judge_name, gate=gate, guard=guard,
                     serving_gauge=gauge)
    return state


def _ray_placement(settings: Settings) -> RayPlacement:
    """The trainer's place on Ray. Joining a cluster happens now, so a bad address or layout is an
    error at start; the local runtime still starts with the first batch (serving starts fast)."""
    placement = RayPlacement(settings.layout, settings.ray_address, settings.train.device,
                             token_path=settings.data_dir / "ray_auth_token")
    if settings.ray_address:
        placement.connect()
    return placement


def _ray_trainer(settings: Settings, model_dir: str, placement: RayPlacement | None, threads: int,
                 gauge: ServingGauge) -> TrainerStarter:
    cfg = settings.train_config()
    assert placement is not None  # made whenever no other trainer is given

    def start() -> RayTrainer:  # blocking (Ray start-up): the loop runs it in a thread
        import ray

        from clawback.trainer.worker import TrainerWorker

        placement.connect()
        actor = ray.remote(TrainerWorker).options(max_concurrency=1, **placement.trainer_options())
        # No adapters dir: the actor keeps its own, wherever it runs; versions travel as bytes. On
        # the daemon's node it yields to the requests counted in the serving gauge.
        serving = (str(gauge.path), ray.get_runtime_context().get_node_id())
        return RayTrainer(actor.remote(model_dir, cfg, None, settings.train.device, threads, serving))

    return start


AUTO_JUDGE_MIN_PARAMS = 1_000_000_000


def _judge(settings: Settings, engine: Engine, renderer: ChatRenderer,
           tokenizer: PreTrainedTokenizerBase) -> tuple[str, JudgeBackend | None]:
    """The judge backend [judge] asks for, and its name ("off": none)."""
    judge = settings.judge
    name = judge.backend
    if name == "auto":  # small models judge near chance (bench/README.md): rely on explicit feedback
        big_enough = engine.info.n_params >= AUTO_JUDGE_MIN_PARAMS
        name = "openai" if judge.url else ("engine" if big_enough else "off")
    if name == "engine":
        return name, EngineBackend(engine, renderer, tokenizer)
    if name == "openai":
        if not (judge.url and judge.model):
            raise ValueError("judge backend 'openai' needs [judge] url and model")
        key = judge.api_key.get_secret_value() if judge.api_key else None
        return name, OpenAIBackend(judge.url, key, judge.model, judge.timeout_s)
    return name, None


def daemon_app(settings: Settings, state: AppState | None = None) -> Any:  # Any: the app behind its auth, as the simulator reaches into it
    """The ASGI app with a lifespan that sweeps idle sessions and shuts everything down cleanly."""
    state = state or build_state(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async def retain() -> None:
            if settings.retain_days:
                scope = ForgetScope(before=time.time() - settings.retain_days * 86400)
                report = await forget(state.store, scope, state.capture)
                if report["deleted"]:
                    log.info("retain_days: forgot %d sessions (%s)", report["sessions"], report["deleted"])

        async def sweeper() -> None:
            await state.capture.sweep_store()  # sessions a previous run left open
            await retain()
            while True:
                await asyncio.sleep(settings.session_sweep_interval_s)
                try:
                    state.capture.sweep()
                    await state.capture.sweep_store()
                    await retain()
                except Exception:
                    log.exception("session sweep failed")

        await state.engine.start()  # vllm/sglang: launch or reach the model server
        await state.adapters.restore()  # serve the version that was live before a restart
        tasks = [asyncio.create_task(sweeper())]
        pipeline, trainer = state.pipeline, state.trainer

        # Both run on the store's writer thread; `wake` is thread-safe.
        state.store.on_sample_pending.append(lambda _: pipeline.wake())
        if trainer is not None:
            state.store.on_sample_ready.append(lambda _: trainer.wake())
        tasks.append(asyncio.create_task(pipeline.run()))
        if trainer is not None:
            tasks.append(asyncio.create_task(trainer.run()))
        if state.guard is not None:
            tasks.append(asyncio.create_task(state.guard.run()))
        log.info("clawback serving %s on %s (auth %s)", state.engine.info.name, settings.base_url,
                 "off" if state.api_key is None else "on")
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if trainer is not None:
                await trainer.close()
            ray = sys.modules.get("ray")  # imported only once training started
            if ray is not None and ray.is_initialized():
                await asyncio.to_thread(ray.shutdown)
            await state.engine.close()
            await asyncio.to_thread(state.store.close)

    return create_app(state, lifespan)
