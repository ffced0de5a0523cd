"""Shared fixtures: the embedded model (converted once, cached under ~/.cache), a tiny random
Llama that shares its tokenizer, and a real daemon process on a free port."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from clawback.engines.supervisor import free_port

CACHE = Path(os.environ.get("CLAWBACK_TEST_CACHE", Path.home() / ".cache" / "clawback"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the embedded model (every model fixture, daemon and engine test does) is in
    the slow tier; `pytest -m "not slow"` runs the rest in seconds. Tests that need something
    slow without that fixture (Ray, OpenClaw) carry the mark themselves."""
    for item in items:
        if "embedded_model_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    from clawback.daemon.config import EMBEDDED_MODEL
    from clawback.daemon.models import CATALOGUE, pull

    return pull(CATALOGUE[EMBEDDED_MODEL], CACHE / "models")


def make_tiny_llama(embedded_model_dir: Path, out: Path, **shape: int) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template: fast, real code paths."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    config = LlamaConfig(
        vocab_size=len(tok), num_hidden_layers=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True, **shape,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    shutil.copy(embedded_model_dir / "generation_config.json", out / "generation_config.json")
    return out


def random_lora(model_dir: Path, root: Path, version: int, method: str = "combined") -> Path:
    """A published adapter version of `model_dir` whose LoRA weights are random (it answers
    unlike the base model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from clawback.adapter_format import publish
    from clawback.trainer.config import TrainConfig
    from clawback.trainer.step import make_lora_model, make_optimizer

    cfg = TrainConfig(lora_rank=4, lora_alpha=8)
    model = make_lora_model(AutoModelForCausalLM.from_pretrained(str(model_dir)), cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    return publish(root, version, model, make_optimizer(model, cfg), {"method": method})


@pytest.fixture(scope="session")
def tiny_model_dir(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(embedded_model_dir, tmp_path_factory.mktemp("tiny-llama"), hidden_size=32,
                           intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="session")
def ending_model_dir(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama made to end its replies by itself after a few tokens: a random model
    never samples its end token by chance, and neither an empty reply nor one cut by the token
    budget is trained on. A large constant in one residual dimension (an attention output bias)
    meets a matching weight in the end token's (tied) embedding row, raising that token's logit; the
    weight is set so that the simulator's sampled replies (temperature 0.7, 160 tokens) end with
    some text before the budget."""
    import torch
    from transformers import LlamaForCausalLM

    from clawback.engine import read_model_info

    out = make_tiny_llama(embedded_model_dir, tmp_path_factory.mktemp("ending-llama"), hidden_size=32,
                          intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    model = LlamaForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        model.model.layers[-1].self_attn.o_proj.bias.zero_()[0] = 100.0
        model.model.norm.weight[0] = 1.0
        for eos in read_model_info(out).eos_token_ids:
            model.model.embed_tokens.weight[eos, 0] = 0.85
    model.save_pretrained(str(out))
    return out


class DaemonProcess:
    """`clawback serve` as a child process, exactly as a user runs it."""

    started: list[DaemonProcess] = []  # every one ever started, stopped at the end of the session

    def __init__(self, data_dir: Path, model_dir: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.data_dir, self.model_dir, self.extra = data_dir, model_dir, extra
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log = data_dir / f"daemon-{self.port}.log"

    def start(self, timeout: float = 120) -> DaemonProcess:
        timeout = scaled(timeout)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "clawback.daemon.cli", "serve", "--data-dir", str(self.data_dir),
               "--model", str(self.model_dir), "--port", str(self.port), *self.extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=self.env)
        DaemonProcess.started.append(self)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited early:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"daemon did not start:\n{self.log.read_text()}")

    @property
    def api_key(self) -> str:
        return (self.data_dir / "api_key").read_text().strip()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: uvicorn runs the lifespan shutdown, the store drains
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session", autouse=True)
def _no_daemon_outlives_the_tests():
    """A test that fails half-way must not leave its daemon (and its Ray runtime) running."""
    yield
    for d in DaemonProcess.started:
        d.stop()


@pytest.fixture
def daemon_factory(tmp_path: Path):
    started: list[DaemonProcess] = []

    def make(model_dir: Path, *extra: str, data_dir: Path | None = None, env: dict[str, str] | None = None,
             timeout: float = 120) -> DaemonProcess:
        d = DaemonProcess(data_dir or tmp_path / "data", model_dir, *extra, env=env)
        started.append(d)
        return d.start(timeout)

    yield make
    for d in started:
        d.stop()


def query(db: Path, sql: str, *args) -> list[sqlite3.Row]:
    """Read the daemon's store from outside, as a user's tools would (rows index by name or position)."""
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


# Deadlines in these tests are what a step takes on an idle 2-core machine, with a wide margin,
# times how much slower this machine runs right now. `slowdown()` runs a fixed single-threaded
# probe: wall time / CPU time is the share of a core this process gets (other load, a lower
# priority), and CPU time / PROBE_IDLE_CPU_S how much slower a core is than the reference one.
# So a test waits as long as the work needs on a busy machine and no longer than needed on a
# quiet one; no assertion is ever about speed.
PROBE_IDLE_CPU_S = 0.028  # the probe's CPU time on the reference machine (2 vCPU KVM guest, 2026-11-30)
MAX_SLOWDOWN = 100.0
# However slow the machine, no single wait lasts longer than MAX_WAIT_S (or its own idle timeout,
# if that is longer), and no test longer than TEST_LIMIT_S: a test that would wait past them fails
# with a message, well inside CI's 90 minutes, instead of hanging.
MAX_WAIT_S = 600.0
TEST_LIMIT_S = 1500.0


def slowdown() -> float:
    """How many times slower than the idle reference machine this one runs now (>= 1)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    sum(i * i for i in range(1_000_000))
    wall, cpu = time.perf_counter() - wall, max(time.thread_time() - cpu, 1e-6)
    return min(MAX_SLOWDOWN, max(1.0, wall / cpu * max(1.0, cpu / PROBE_IDLE_CPU_S)))


def bounded(seconds: float, factor: float) -> float:
    """`seconds` stretched by `factor`, at most MAX_WAIT_S (or `seconds`, if longer)."""
    return min(seconds * factor, max(seconds, MAX_WAIT_S))


def scaled(seconds: float) -> float:
    """A client timeout or deadline of `seconds` on the idle machine, for this machine now."""
    return bounded(seconds, slowdown())


@pytest.fixture(autouse=True)
def _test_time_limit(request: pytest.FixtureRequest):
    """A test still running after TEST_LIMIT_S fails where it is (SIGALRM raises in the main
    thread, interrupting a sleep or a socket read), and its fixtures clean up."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"{request.node.nodeid} ran past the {TEST_LIMIT_S:.0f} s limit of one test")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, TEST_LIMIT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def wait_for(fn, timeout: float = 30, what: str = "condition", interval: float = 0.1):
    """Poll until fn() is truthy (the store is written in the background); return its value.

    `timeout` is for the idle reference machine: the deadline stretches by the largest slowdown
    measured while waiting (probed every few seconds)."""
    start = time.time()
    worst = slowdown()
    next_probe = start + 5
    while True:
        value = fn()
        if value:
            return value
        now = time.time()
        if now >= next_probe:
            worst, next_probe = max(worst, slowdown()), now + 5
        if now - start > bounded(timeout, worst):
            raise AssertionError(f"{what} not met within {now - start:.0f} s ({timeout} s x slowdown {worst:.1f}, "
                                 f"at most {max(timeout, MAX_WAIT_S):.0f} s)")
        time.sleep(interval)


def stream_clients(url: str, n: int, stop: threading.Event, results: list, errors: list) -> list[threading.Thread]:
    """`n` threads that stream side calls until `stop`: each finished stream appends (call id, the
    version that served it) to `results`, each failure its repr to `errors`. Not started."""

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=scaled(120)) as c:
            while not stop.is_set():
                try:
                    body = {"model": "clawback", "stream": True, "max_tokens": 16, "temperature": 1.0,
                            "messages": [{"role": "user", "content": f"client {i} says hello"}]}
                    with c.stream("POST", "/v1/chat/completions", json=body,
                                  headers={"x-session-id": f"load-{i}", "x-turn-type": "side"}) as r:
                        assert r.status_code == 200, r.status_code
                        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
                    assert lines[-1] == "data: [DONE]", lines[-1]
                    first = json.loads(lines[0][len("data: "):])
                    results.append((r.headers["x-clawback-call-id"], first["system_fingerprint"]))
                except Exception as e:  # every failure counts
                    errors.append(repr(e))

    return [threading.Thread(target=client, args=(i,)) for i in range(n)]
