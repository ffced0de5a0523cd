"""The SGLang engine against a FAKE SGLang server (tests/engines/fake_sglang.py).

Faked: the SGLang server itself, because SGLang cannot run on this CPU-only machine or in CI
(its PyPI kernels are CUDA builds). The fake speaks SGLang's HTTP shapes and computes
every logprob with transformers + PEFT, so the numbers checked here are real. Everything on our
side is real: the engine launches the fake as its supervised child with the exact command line
it gives SGLang, talks to it over HTTP, restarts it when killed, and stops it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from clawback.daemon.config import Settings
from clawback.engine import EngineError, Sampling
from clawback.engines import build_engine
from clawback.engines.embedded import EmbeddedEngine
from clawback.engines.sglang import SGLangEngine

from ..conftest import wait_for
from .conftest import make_adapters

FAKE = Path(__file__).with_name("fake_sglang.py")
PROMPT = [1, 520, 33, 4481, 28, 2, 198, 77, 9000]


def sglang_settings(data_dir: Path, **extra) -> Settings:
    return Settings(data_dir=data_dir, engine="sglang", engine_command=f"{sys.executable} {FAKE}",
                    train={"lora_rank": 8}, engine_start_timeout_s=300, **extra)


def start_engine(loop, model_dir: Path, data_dir: Path) -> SGLangEngine:
    engine = build_engine(sglang_settings(data_dir).engine_config(), str(model_dir))
    loop.run(engine.start())
    return engine


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(tiny_model_dir, tmp_path_factory.mktemp("adapters"), n=3)


@pytest.fixture(scope="module")
def engine(loop, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    e = start_engine(loop, tiny_model_dir, tmp_path_factory.mktemp("sglang-data"))
    yield e
    loop.run(e.close())


@pytest.fixture(scope="module")
def embedded(tiny_model_dir: Path, adapters: dict[str, Path]):
    """The reference: the same model and adapters in the embedded engine."""
    e = EmbeddedEngine(tiny_model_dir, device="cpu", dtype="float32")
    for name in ("v1", "v2"):
        asyncio.run(e.load_adapter(name, str(adapters[name])))
    yield e
    asyncio.run(e.close())


def fake_stats(engine: SGLangEngine) -> dict:
    return httpx.get(f"{engine.endpoint.base_url}/fake/stats", timeout=10).json()


async def collect(engine, sampling: Sampling, adapter: str | None = None, prompt=PROMPT):
    return [t async for t in engine.generate(prompt, sampling, adapter)]


def test_launch_command_is_sglangs(engine: SGLangEngine):
    """The child got SGLang's flags (the fake rejects unknown ones) and the env var that makes
    SGLang report temperature-1 logprobs."""
    cmd = engine.server.command
    for flag in ("--enable-lora", "--max-lora-rank", "--lora-target-modules", "--max-loras-per-batch",
                 "--mem-fraction-static", "--api-key", "--admin-api-key", "--enable-metrics", "--served-model-name"):
        assert flag in cmd
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert cmd[cmd.index("--max-loras-per-batch") + 1] == "3"
    targets = cmd[cmd.index("--lora-target-modules") + 1: cmd.index("--max-loras-per-batch")]
    assert targets == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert engine.server.env["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "1"


def test_generation_logprobs_are_temperature_1_and_match_the_embedded_engine(loop, engine, embedded):
    toks = loop.run(collect(engine, Sampling(temperature=0.7, top_p=0.9, max_tokens=20, seed=3)))
    assert len(toks) == 20
    ids = [t.id for t in toks]
    rescored = loop.run(engine.score(PROMPT, ids))
    assert max(abs(a - t.logprob) for a, t in zip(rescored, toks)) < 1e-4
    reference = asyncio.run(embedded.score(PROMPT, ids))
    assert max(abs(a - t.logprob) for a, t in zip(reference, toks)) < 1e-4


def test_seeded_generation_reproduces(loop, engine):
    a = loop.run(collect(engine, Sampling(temperature=1.0, max_tokens=8, seed=11)))
    b = loop.run(collect(engine, Sampling(temperature=1.0, max_tokens=8, seed=11)))
    assert [t.id for t in a] == [t.id for t in b]


def test_scoring_with_an_adapter_matches_the_embedded_engine(loop, engine, embedded, adapters):
    loop.run(engine.load_adapter("v1", str(adapters["v1"])))
    try:
        resp = [10, 20, 30, 40, 50]
        ours = loop.run(engine.score(PROMPT, resp, "v1"))
        ref = asyncio.run(embedded.score(PROMPT, resp, "v1"))
        base = asyncio.run(embedded.score(PROMPT, resp))
        assert max(abs(a - b) for a, b in zip(ours, ref)) < 1e-4
        assert max(abs(a - b) for a, b in zip(ours, base)) > 1e-3, "the adapter was applied"
    finally:
        loop.run(engine.unload("v1"))


def test_top_k_at_serve_time_and_the_teachers_view_of_it_match_the_embedded_engine(loop, engine, embedded, adapters):
    """Top-K OPD on SGLang: the policy's top-4 comes with the served tokens (`top_logprobs_num`),
    and the teacher's logprobs of those ids at every position come from `token_ids_logprob` on a
    scoring request (one id list per request, so the engine asks for each window's union). The
    reply is longer than one window, so two requests cover it."""
    from clawback.engines.sglang import CANDIDATE_WINDOW

    loop.run(engine.load_adapter("v1", str(adapters["v1"])))
    try:
        sampling = Sampling(temperature=1.0, max_tokens=CANDIDATE_WINDOW + 6, seed=5, top_logprobs=4)
        toks = loop.run(collect(engine, sampling, "v1"))
        ids, top_ids = [t.id for t in toks], [list(t.top_ids) for t in toks]
        ref = asyncio.run(embedded.score_candidates(PROMPT, ids, top_ids, "v1"))
        assert all(len(row) == 4 for row in top_ids)
        assert max(abs(a - b) for t, row in zip(toks, ref) for a, b in zip(t.top_logprobs, row)) < 1e-4
        assert all(list(row) == sorted(row, reverse=True) for row in ref), "served most likely first"

        teacher_prompt = PROMPT + [198, 77, 520]  # another context: the hinted request
        before = len(fake_stats(engine)["token_ids_logprob_widths"])
        ours = loop.run(engine.score_candidates(teacher_prompt, ids, top_ids, "v1"))
        ref = asyncio.run(embedded.score_candidates(teacher_prompt, ids, top_ids, "v1"))
        base = asyncio.run(embedded.score_candidates(teacher_prompt, ids, top_ids))
        assert max(abs(a - b) for x, y in zip(ours, ref) for a, b in zip(x, y)) < 1e-4
        assert max(abs(a - b) for x, y in zip(ours, base) for a, b in zip(x, y)) > 1e-3, "the adapter was applied"
        widths = fake_stats(engine)["token_ids_logprob_widths"][before:]
        assert len(widths) == 2
        assert widths[0] == len({t for row in top_ids[:CANDIDATE_WINDOW] for t in row})
        with pytest.raises(EngineError, match="candidate rows"):
            loop.run(engine.score_candidates(teacher_prompt, ids, top_ids[:-1], "v1"))
    finally:
        loop.run(engine.unload("v1"))


def test_hot_swap_with_streams_in_flight(loop, engine, embedded, adapters):
    """v1 serves four long streams when v2 goes live: the swap returns at once, the streams
    finish on v1, new requests get v2, v1 is unloaded on the server only after its last stream,
    and no unloaded name is ever requested again (SGLang would silently re-load it)."""
    async def go():
        await engine.load_adapter("v1", str(adapters["v1"]))
        await engine.activate("v1")
        streams = [engine.generate(PROMPT, Sampling(temperature=1.0, max_tokens=30, seed=i), "v1") for i in range(4)]
        firsts = [await s.__anext__() for s in streams]
        v1_name = engine.server_names()["v1"]

        await engine.load_adapter("v2", str(adapters["v2"]))
        await engine.activate("v2")
        await engine.unload("v1")  # deferred: four streams still use it
        assert engine.loaded_versions() == ["v2"]
        assert v1_name in fake_stats(engine)["loaded"], "not unloaded on the server while in use"
        with pytest.raises(EngineError, match="not loaded"):
            await collect(engine, Sampling(max_tokens=2), "v1")
        new = await collect(engine, Sampling(temperature=1.0, max_tokens=5), engine.active_version())

        results = []
        for first, s in zip(firsts, streams):
            results.append([first] + [t async for t in s])
        return v1_name, results, new

    v1_name, results, new = loop.run(go())
    assert [len(r) for r in results] == [30] * 4, "every in-flight stream finished"
    for toks in results:  # on v1's weights
        ref = asyncio.run(embedded.score(PROMPT, [t.id for t in toks], "v1"))
        assert max(abs(a - t.logprob) for a, t in zip(ref, toks)) < 1e-4
    assert len(new) == 5
    wait_for(lambda: v1_name not in fake_stats(engine)["loaded"], what="v1 unloaded after its streams")
    stats = fake_stats(engine)
    assert stats["requests_by_name"][engine.server_names()["v2"]] >= 1, "new requests went to v2"
    assert stats["resurrected"] == []

    # Roll back to v1: it comes back under a new name, never the unloaded one.
    loop.run(engine.load_adapter("v1", str(adapters["v1"])))
    loop.run(engine.activate("v1"))
    assert engine.server_names()["v1"] != v1_name
    loop.run(collect(engine, Sampling(max_tokens=3), "v1"))
    loop.run(engine.unload("v2"))
    loop.run(engine.activate(None))
    loop.run(engine.unload("v1"))
    assert fake_stats(engine)["resurrected"] == []


def test_rollback_to_a_retiring_version_keeps_it(loop, engine, adapters):
    async def go():
        await engine.load_adapter("v1", str(adapters["v1"]))
        await engine.load_adapter("v2", str(adapters["v2"]))
        await engine.activate("v2")
        stream = engine.generate(PROMPT, Sampling(temperature=1.0, max_tokens=20), "v2")
        await stream.__anext__()
        name = engine.server_names()["v2"]
        await engine.activate("v1")
        await engine.unload("v2")  # retiring
        await engine.load_adapter("v2", str(adapters["v2"]))  # back before its unload went out
        rest = [t async for t in stream]
        assert len(rest) == 19
        assert sorted(engine.loaded_versions()) == ["v1", "v2"] and engine.server_names()["v2"] == name
        await engine.unload("v2")
        await engine.activate(None)
        await engine.unload("v1")

    loop.run(go())
    assert fake_stats(engine)["resurrected"] == []


def test_bad_calls_raise_and_change_nothing(loop, engine, tiny_model_dir: Path, tmp_path: Path):
    before = dict(fake_stats(engine)["requests_by_name"])
    with pytest.raises(EngineError, match="not loaded"):
        loop.run(collect(engine, Sampling(max_tokens=2), "v9"))
    with pytest.raises(EngineError):
        loop.run(engine.score(PROMPT, [1, 2], "v9"))
    assert fake_stats(engine)["requests_by_name"] == before, "nothing was sent for an unknown version"
    with pytest.raises(EngineError, match="adapter_config.json"):
        loop.run(engine.load_adapter("v7", str(tmp_path / "missing")))
    big = make_adapters(tiny_model_dir, tmp_path, n=1, rank=16)["v1"]
    with pytest.raises(EngineError, match="incompatible"):  # rank 16 > --max-lora-rank 8
        loop.run(engine.load_adapter("v7", str(big)))
    assert "v7" not in engine.loaded_versions()
    with pytest.raises(EngineError):
        loop.run(engine.activate("v7"))
    with pytest.raises(EngineError):
        loop.run(collect(engine, Sampling(), prompt=[]))
    with pytest.raises(EngineError):
        loop.run(engine.score(PROMPT, [5] * 600))  # past the 512-token context
    assert engine.active_version() is None
    assert loop.run(collect(engine, Sampling(max_tokens=2)))


def test_secrets_stay_out_of_the_logs(engine: SGLangEngine, caplog):
    key, admin = engine.endpoint.api_key, engine.endpoint.admin_api_key
    log_text = engine.server.log_path.read_text()
    assert "server_args=" in log_text, "the child's output is in its log"
    assert key not in log_text and admin not in log_text
    assert "***" in log_text
    assert key not in engine.server.redacted_command()


def test_a_killed_server_is_restarted_and_its_adapters_come_back(loop, tiny_model_dir, adapters, tmp_path: Path):
    engine = start_engine(loop, tiny_model_dir, tmp_path)
    engine.server.health_interval_s = 0.2
    try:
        loop.run(engine.load_adapter("v3", str(adapters["v3"])))
        loop.run(engine.activate("v3"))
        old_pid, old_name = engine.server.pid, engine.server_names()["v3"]
        before = loop.run(engine.score(PROMPT, [10, 20, 30], "v3"))
        os.kill(old_pid, signal.SIGKILL)
        wait_for(lambda: engine.server.restarts == 1 and "v3" in engine.server_names()
                 and engine.server_names()["v3"] != old_name, timeout=300, what="restart")
        assert engine.server.pid != old_pid
        assert engine.active_version() == "v3"
        after = loop.run(engine.score(PROMPT, [10, 20, 30], "v3"))
        assert after == pytest.approx(before, abs=1e-5)
        assert fake_stats(engine)["resurrected"] == []
    finally:
        loop.run(engine.close())
    assert _gone(old_pid) and _gone(engine.server.pid)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.name))
    return out


def test_daemon_serves_through_sglang_and_stops_it(daemon_factory, tiny_model_dir: Path, tmp_path: Path):
    """`clawback serve --engine sglang`: a chat completion goes through the (fake) server, and
    stopping the daemon stops the server."""
    d = daemon_factory(tiny_model_dir, "--engine", "sglang",
                       env={"CLAWBACK_ENGINE_COMMAND": f"{sys.executable} {FAKE}", "CLAWBACK_TRAIN__LORA_RANK": "8",
                            "CLAWBACK_TRAIN__ENABLED": "false"})
    children = _children(d.proc.pid)
    assert children, "the daemon launched its model server"
    r = httpx.post(f"{d.url}/v1/chat/completions", headers={"authorization": f"Bearer {d.api_key}"},
                   json={"model": "clawback", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
                         "logprobs": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"]) >= 1
    d.stop()
    deadline = time.time() + 30
    while time.time() < deadline and not all(_gone(c) for c in children):
        time.sleep(0.2)
    assert all(_gone(c) for c in children), "the model server outlived the daemon"


def test_attach_to_a_running_server_without_supervising_it(loop, engine: SGLangEngine, tiny_model_dir: Path,
                                                          tmp_path: Path):
    """engine_url: the engine uses a server someone else runs, and leaves it running on close."""
    attached = build_engine(Settings(data_dir=tmp_path, engine="sglang", engine_url=engine.endpoint.base_url,
                                     engine_api_key=engine.endpoint.api_key).engine_config(), str(tiny_model_dir))
    assert attached.server is None
    loop.run(attached.start())
    toks = loop.run(collect(attached, Sampling(temperature=0, max_tokens=4)))
    assert [t.id for t in toks] == [t.id for t in loop.run(collect(engine, Sampling(temperature=0, max_tokens=4)))]
    loop.run(attached.close())
    assert engine.server.proc.poll() is None, "the attached engine did not stop the server"


def test_a_server_that_cannot_start_is_a_clear_error(loop, tiny_model_dir: Path, tmp_path: Path):
    settings = Settings(data_dir=tmp_path, engine="sglang", train={"lora_rank": 8},
                        engine_command=f"{sys.executable} -c 'import sys; print(\"no GPU\"); sys.exit(3)'")
    engine = build_engine(settings.engine_config(), str(tiny_model_dir))
    with pytest.raises(EngineError, match=r"exited with code 3(.|\n)*no GPU"):
        loop.run(engine.start())
    loop.run(engine.close())


def test_a_taken_port_is_replaced_by_a_free_one(loop, tiny_model_dir: Path, tmp_path: Path):
    """Another process binds the port we picked before the server does: the server starts on
    another free port and the engine follows it."""
    import socket

    engine = build_engine(sglang_settings(tmp_path).engine_config(), str(tiny_model_dir))
    picked = int(engine.server.command[engine.server.command.index("--port") + 1])
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", picked))
        squatter.listen()
        try:
            loop.run(engine.start())
            assert engine.endpoint.base_url != f"http://127.0.0.1:{picked}"
            assert loop.run(collect(engine, Sampling(max_tokens=2)))
        finally:
            loop.run(engine.close())
