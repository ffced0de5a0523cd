"""What the serving benchmarks (hot_swap.py, serve_overhead.py) share: the daemon as a child
process, a tiny model, CPU accounting, percentiles and the machine's description."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from clawback.engines.supervisor import free_port

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = Path.home() / ".cache" / "clawback" / "models" / "smollm2-135m-instruct"


def cpu_ns(pid: int | str = "self") -> int:
    """CPU time (ns) used so far by all live threads of a process, from /proc/<pid>/task/*/schedstat.

    Threads that exited are not counted; the daemon's and the benchmark's threads are long-lived.
    """
    total = 0
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                total += int((task / "schedstat").read_text().split()[0])
    return total


def machine_busy_ns() -> int:
    """CPU time (ns) all processes on the machine have used, from /proc/stat (user+nice+system+irq+softirq+steal)."""
    f = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    busy = sum(int(f[i]) for i in (0, 1, 2, 5, 6, 7))
    return busy * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default), without needing numpy."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99), "mean": statistics.fmean(xs),
            "stdev": statistics.stdev(xs) if len(xs) > 1 else 0.0, "min": min(xs), "max": max(xs)}


def machine() -> dict[str, Any]:
    import peft
    import torch
    import transformers

    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    return {"nproc": os.cpu_count(), "lscpu": lscpu[:12], "loadavg_at_start": Path("/proc/loadavg").read_text().strip(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "platform": platform.platform()}


def tiny_model(embedded: Path, out: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template (as in tests/conftest.py).

    Its forward pass costs about a millisecond, so what is left of a request is the serving path:
    the daemon's overhead can be resolved to a fraction of a millisecond instead of drowning in the
    +-5% noise of the 135M model's compute.
    """
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(str(embedded))
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    tok.save_pretrained(str(out))
    shutil.copy(embedded / "generation_config.json", out / "generation_config.json")
    return out


class Daemon:
    """`clawback serve` as a child process on a free port, with its log in its data dir.

    `entry` replaces `-m clawback.daemon.cli` (a wrapper script that instruments the daemon)."""

    def __init__(self, model_dir: Path, data_dir: Path, threads: int, device: str, log_level: str,
                 env: dict[str, str] | None = None, entry: list[str] | None = None) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir / f"daemon-{self.port}.log"
        full_env = {**os.environ, "CLAWBACK_TORCH_THREADS": str(threads), **(env or {})}
        full_env.pop("CLAWBACK_DATA_DIR", None)
        self.env = {k: full_env[k] for k in sorted(full_env) if k.startswith("CLAWBACK_")}
        self.cmd = [sys.executable, *(entry or ["-m", "clawback.daemon.cli"]), "serve", "--model", str(model_dir),
                    "--port", str(self.port), "--data-dir", str(data_dir), "--no-auth",
                    "--device", device, "--log-level", log_level]
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=full_env,
                                     cwd=REPO)

    def wait_ready(self, timeout: float = 300) -> Daemon:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited early:\n{self.log.read_text()[-4000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            time.sleep(0.2)
        raise TimeoutError(f"daemon did not start:\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: the lifespan shutdown drains the store, stops Ray
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def write_result(name: str, record: dict[str, Any]) -> Path:
    """bench/results/<name>-<timestamp>.json, with the machine it ran on."""
    import datetime as dt
    import json

    out = REPO / "bench" / "results" / f"{name}-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**record, "machine": machine()}, indent=1))
    print(f"wrote {out}")
    return out
