"""Assembling a daemon: engine, store, capture, signals, training and the app's lifespan.

Everything the routes in `api.py` use is built here once from the settings and shut down in
reverse order; the lifespan also runs the background tasks (idle-session sweep, the sample
pipeline, the training loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from typing import Any

from fastapi import FastAPI

from clawback.chat import ChatRenderer
from clawback.judge.backends import EngineBackend, OpenAIBackend
from clawback.trainer.config import TrainConfig, preset

from .adapters import AdapterManager
from .api import AppState, create_app, resolve_api_key
from .capture import Capture
from .config import Settings
from .layout import RayPlacement
from .samples import SamplePipeline, SignalConfig
from .store import Store
from .training import TrainingLoop

log = logging.getLogger(__name__)


def build_state(settings: Settings) -> AppState:
    """Load model, tokenizer, store: everything the routes need."""
    from transformers import AutoTokenizer

    from .engines import build_engine
    from .models import resolve_model

    placement = _ray_placement(settings)  # first: a layout the cluster cannot host fails before anything is built
    model_dir = resolve_model(settings.model, settings.models_dir)
    engine = build_engine(settings, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    store = Store(settings.db_path, queue_size=settings.store_queue_size, memory_max_notes=settings.memory_max_notes)
    capture = Capture(store, settings.session_idle_timeout_s, settings.session_cache_size)
    state = AppState(settings, engine, ChatRenderer(tokenizer), store, capture, resolve_api_key(settings))
    state.pipeline = _sample_pipeline(settings, state, tokenizer)
    state.adapters = AdapterManager(
        engine, store, settings.data_dir / "adapters", settings.keep_versions,
        on_live=lambda v: state.hub.broadcast({"type": "adapter_live", "version": None if v is None else f"v{v}"}))
    if settings.train:
        state.trainer = _training_loop(settings, state, model_dir, placement)
    return state


def _ray_placement(settings: Settings) -> RayPlacement | None:
    """The trainer's place on Ray. Joining a cluster happens now, so a bad address or layout is an
    error at start; the local runtime still starts with the first batch (serving starts fast)."""
    if not settings.train:
        return None
    placement = RayPlacement(settings.layout, settings.ray_address, settings.trainer_device)
    if settings.ray_address:
        placement.connect()
    return placement


def train_config(settings: Settings, preset_name: str | None = None, **overrides: Any) -> TrainConfig:
    """The trainer's config from the settings (on a named preset's other values when given)."""
    values = dict(method=settings.method, lr=settings.lr, lora_rank=settings.lora_rank,
                  lora_alpha=settings.lora_alpha, batch_size=settings.batch_size,
                  micro_batch_tokens=settings.micro_batch_tokens, max_staleness=settings.max_staleness,
                  opd_top_k=settings.opd_top_k, opd_clip=settings.opd_clip, kl_coef=settings.kl_coef,
                  evidence_weight=settings.evidence_weight)
    return preset(preset_name or settings.method, **{**values, **overrides})


def _training_loop(settings: Settings, state: AppState, model_dir: str, placement: RayPlacement) -> Any:
    cfg = train_config(settings)

    def start_worker() -> Any:  # blocking (Ray start-up): the loop runs it in a thread
        import ray

        from clawback.trainer.worker import TrainerWorker

        placement.connect()
        actor = ray.remote(TrainerWorker).options(max_concurrency=1, **placement.trainer_options())
        # No adapters dir: the actor keeps its own, wherever it runs; versions travel as bytes.
        return actor.remote(model_dir, cfg, None, settings.trainer_device, settings.trainer_threads)

    def on_trained(step: dict[str, Any]) -> None:
        state.hub.broadcast({"type": "trained", "version": step["version"], "samples": step["samples"],
                             "mean_reward": step["mean_reward"]})

    return TrainingLoop(state.store, state.adapters, cfg, start_worker, on_trained)


AUTO_JUDGE_MIN_PARAMS = 1_000_000_000


def _sample_pipeline(settings: Settings, state: AppState, tokenizer: Any) -> Any:
    judge = settings.judge
    if judge == "auto":  # small models judge near chance (bench/README.md): rely on explicit feedback
        big_enough = state.engine.info.n_params >= AUTO_JUDGE_MIN_PARAMS
        judge = "openai" if settings.judge_url else ("engine" if big_enough else "off")
    backend: Any = None
    if judge == "engine":
        backend = EngineBackend(state.engine, state.renderer, tokenizer)
    elif judge == "openai":
        if not (settings.judge_url and settings.judge_model):
            raise ValueError("judge 'openai' needs judge_url and judge_model")
        key = settings.judge_api_key.get_secret_value() if settings.judge_api_key else None
        backend = OpenAIBackend(settings.judge_url, key, settings.judge_model, settings.judge_timeout_s)
    state.judge_name = judge
    cfg = SignalConfig(method=settings.method, teacher=settings.teacher, judge_votes=settings.judge_votes,
                       judge_temperature=settings.judge_temperature, judge_max_tokens=settings.judge_max_tokens,
                       judge_timeout_s=settings.judge_timeout_s, judge_retries=settings.judge_retries,
                       concurrency=settings.judge_concurrency, judge_context=settings.judge_context,
                       count_zero_signal=settings.count_zero_signal, hint_template=settings.hint_template,
                       hint_placement=settings.hint_placement, positive_evidence=settings.evidence_weight > 0)

    def on_ready(sample: dict[str, Any]) -> None:
        state.hub.broadcast({"type": "sample_ready", **sample})

    return SamplePipeline(state.store, state.engine, state.renderer, backend, cfg, on_ready)


def daemon_app(settings: Settings, state: AppState | None = None) -> Any:
    """The ASGI app with a lifespan that sweeps idle sessions and shuts everything down cleanly."""
    state = state or build_state(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        async def sweeper() -> None:
            await state.capture.sweep_store()  # sessions a previous run left open
            while True:
                await asyncio.sleep(settings.session_sweep_interval_s)
                try:
                    state.capture.sweep()
                    await state.capture.sweep_store()
                except Exception:
                    log.exception("session sweep failed")

        start = getattr(state.engine, "start", None)  # vllm/sglang: launch or reach the model server
        if start is not None:
            await start()
        await state.adapters.restore()  # serve the version that was live before a restart
        tasks = [asyncio.create_task(sweeper())]
        pipeline, trainer = state.pipeline, state.trainer

        def on_commit(kind: str, _: str) -> None:  # runs on the store's writer thread
            if kind == "sample.pending" and pipeline is not None:
                pipeline.wake()
            elif kind == "sample.ready" and trainer is not None:
                trainer.wake()

        state.store.listeners.append(on_commit)
        if pipeline is not None:
            tasks.append(asyncio.create_task(pipeline.run()))
        if trainer is not None:
            tasks.append(asyncio.create_task(trainer.run()))
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
