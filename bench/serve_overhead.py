"""How much latency and throughput does the HTTP daemon add over calling the engine directly?

Starts the real daemon (`python -m clawback.daemon.cli serve ...`) as a child process and, in this
process, an `EmbeddedEngine` on the same model dir plus a `ChatRenderer` on its tokenizer. Both
sides do the same work for the same messages: render them to prompt ids and generate the same
number of tokens greedily. Requests alternate between the two sides (one at a time, order flipped
every pair so neither side always goes first), so the per-pair difference http - direct is the
daemon's overhead, not queueing.

    .venv/bin/python bench/serve_overhead.py                              # 30 pairs, max_tokens 16 and 64
    .venv/bin/python bench/serve_overhead.py --model tiny --pairs 100     # the overhead without compute noise
    .venv/bin/python bench/serve_overhead.py --quiet-wait 30              # on a shared machine
    .venv/bin/python bench/serve_overhead.py --model tiny --client httpx  # through httpx instead of a raw socket

Prints a table and writes bench/results/serve_overhead-<timestamp>.json (raw pairs included).
Targets: added latency <= 0.5 ms p50 and <= 2 ms p99 (streaming: plus <= 0.1 ms per generated
token), throughput ratio >= 0.98. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import hashlib
import json
import shutil
import socket
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _common import DEFAULT_MODEL, REPO, Daemon, cpu_ns, machine, machine_busy_ns, pct, summary, tiny_model

# Added latency per request (p50, p99), plus per generated token when streaming; throughput ratio.
TARGET_P50_MS, TARGET_P99_MS, TARGET_STREAM_TOKEN_MS, TARGET_RATIO = 0.5, 2.0, 0.1, 0.98

# Candidates; only those whose greedy reply does not end before the largest max_tokens are used, so
# every request of a setting generates exactly max_tokens tokens on both sides.
PROMPTS = [
    "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a bicycle works, covering the frame, gears, brakes and wheels.",
    "Describe the water cycle step by step for a school textbook chapter.",
    "Write a travel guide to a small coastal town: food, walks, history and where to stay.",
]
SYSTEM = "You are a helpful assistant."


# ---------------------------------------------------------------- small helpers


def median_ci95(xs: list[float]) -> tuple[float, float]:
    """Distribution-free ~95% confidence interval of the median (order statistics n/2 -+ 0.98 sqrt(n))."""
    s = sorted(xs)
    n = len(s)
    lo = max(int(n / 2 - 0.98 * n**0.5), 0)
    hi = min(int(n / 2 + 0.98 * n**0.5 + 0.999), n - 1)
    return s[lo], s[hi]


# ---------------------------------------------------------------- the daemon


class BenchDaemon(Daemon):
    def __init__(self, model_dir: Path, threads: int, device: str, log_level: str, wrapper: Path | None = None) -> None:
        super().__init__(model_dir, Path(tempfile.mkdtemp(prefix="clawback-bench-")), threads, device, log_level,
                         entry=[str(wrapper)] if wrapper else None)

    def server_timings(self) -> dict[str, dict[str, float]]:
        """call_id -> the timings the daemon itself recorded (render_s, ttft_s, total_s)."""
        db = self.data_dir / "clawback.db"
        if not db.is_file():
            return {}
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
        try:
            return {cid: json.loads(t) for cid, t in conn.execute("SELECT call_id, timings_json FROM calls")}
        finally:
            conn.close()


# ---------------------------------------------------------------- the two sides


class Direct:
    """The engine called in-process: render, generate greedily, decode the reply once."""

    def __init__(self, model_dir: Path, threads: int, device: str) -> None:
        import torch
        from transformers import AutoTokenizer

        from clawback.chat import ChatRenderer
        from clawback.engines.embedded import EmbeddedEngine

        torch.set_num_threads(threads)
        self.engine = EmbeddedEngine(model_dir, device=device, name=model_dir.name, torch_threads=threads)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.renderer = ChatRenderer(self.tokenizer)
        self.loop = asyncio.new_event_loop()

    def run(self, req: Any, max_tokens: int) -> dict[str, Any]:
        c0 = cpu_ns()
        t0 = time.perf_counter_ns()
        out = self.loop.run_until_complete(self._generate(req, max_tokens, t0))
        t1 = time.perf_counter_ns()
        out["total_ms"] = (t1 - t0) / 1e6
        out["cpu_ms"] = (cpu_ns() - c0) / 1e6
        return out

    async def _generate(self, req: Any, max_tokens: int, t0: int) -> dict[str, Any]:
        from clawback.engine import Sampling

        _, prompt_ids = self.renderer.render(req)
        rendered = time.perf_counter_ns()
        info = self.engine.info
        sampling = Sampling(temperature=0.0, top_p=1.0, max_tokens=min(max_tokens, info.context_length - len(prompt_ids)),
                            stop_token_ids=info.eos_token_ids)
        ids: list[int] = []
        stamps: list[int] = []
        async with contextlib.aclosing(self.engine.generate(prompt_ids, sampling)) as stream:
            async for tok in stream:
                stamps.append(time.perf_counter_ns())
                ids.append(tok.id)
        eos = set(info.eos_token_ids)
        text = self.tokenizer.decode([i for i in ids if i not in eos], skip_special_tokens=True)
        steps = [(b - a) / 1e6 for a, b in zip(stamps, stamps[1:])]
        return {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "text": text,
                "hit_eos": bool(ids) and ids[-1] in eos, "render_ms": (rendered - t0) / 1e6,
                "ttft_ms": (stamps[0] - t0) / 1e6 if stamps else None,
                "step_ms_median": statistics.median(steps) if steps else None}

    def engine_only(self, prompt_ids: list[int], n: int) -> dict[str, Any]:
        """The model alone, on this thread (the engine's worker is idle): prefill + n-1 decode steps,
        each with the argmax and the full-vocab log_softmax the engine computes per token."""
        import torch
        from transformers import DynamicCache

        eng = self.engine
        times: list[float] = []
        with torch.inference_mode():
            cache, inp = DynamicCache(), list(prompt_ids)
            for _ in range(n):
                t = time.perf_counter_ns()
                out = eng._forward(torch.tensor([inp]), [None], cache)
                cache = out.cache
                logits = out.logits[0, -1].float()
                tok = int(torch.argmax(logits))
                float(torch.log_softmax(logits, dim=-1)[tok])
                inp = [tok]
                times.append((time.perf_counter_ns() - t) / 1e6)
        return {"prefill_ms": times[0], "decode_step_ms": times[1:]}

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.close())
        self.loop.close()


class Http:
    """The daemon over HTTP/1.1 with one persistent connection, through httpx (what most Python
    clients, the OpenAI SDK included, use)."""

    def __init__(self, url: str, turn_type: str = "side") -> None:
        self.client = httpx.Client(base_url=url, timeout=600)
        self.turn_type = turn_type

    def body(self, messages: list[dict], max_tokens: int, stream: bool) -> dict[str, Any]:
        b: dict[str, Any] = {"model": "clawback", "messages": messages, "temperature": 0, "max_tokens": max_tokens}
        if self.turn_type == "main":  # one session per prompt; each repeat closes the last call as retried
            b["turn_type"] = "main"
            b["session_id"] = "bench-" + hashlib.sha1(json.dumps(messages).encode()).hexdigest()[:12]
        if stream:
            b["stream"] = True
            b["stream_options"] = {"include_usage": True}
        return b

    def run(self, messages: list[dict], max_tokens: int, stream: bool, daemon_pid: int) -> dict[str, Any]:
        body = self.body(messages, max_tokens, stream)
        c0, d0 = cpu_ns(), cpu_ns(daemon_pid)
        t0 = time.perf_counter_ns()
        out = self._stream(body, t0) if stream else self._plain(body)
        t1 = out.pop("done_at", None) or time.perf_counter_ns()  # streaming: when `data: [DONE]` arrived
        out["total_ms"] = (t1 - t0) / 1e6
        out["client_cpu_ms"] = (cpu_ns() - c0) / 1e6
        out["daemon_cpu_ms"] = (cpu_ns(daemon_pid) - d0) / 1e6
        return out

    @staticmethod
    def reply(data: dict[str, Any]) -> dict[str, Any]:
        return {"call_id": data["id"], "prompt_tokens": data["usage"]["prompt_tokens"],
                "completion_tokens": data["usage"]["completion_tokens"],
                "text": data["choices"][0]["message"]["content"] or "",
                "finish_reason": data["choices"][0]["finish_reason"]}

    @staticmethod
    def events(payloads: list[tuple[int, bytes]], t0: int) -> dict[str, Any]:
        """The streamed reply from its SSE `data:` payloads, each with the time it arrived."""
        parts: list[str] = []
        usage: dict[str, int] = {}
        call_id = finish = ttft = None
        chunks = 0
        for at, payload in payloads:
            if payload == b"[DONE]":
                break
            chunks += 1
            data = json.loads(payload)
            call_id = data["id"]
            if data.get("usage"):
                usage = data["usage"]
            for choice in data.get("choices", []):
                text = choice["delta"].get("content")
                if text:
                    if ttft is None:
                        ttft = (at - t0) / 1e6
                    parts.append(text)
                finish = choice.get("finish_reason") or finish
        return {"call_id": call_id, "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"), "text": "".join(parts),
                "finish_reason": finish, "ttft_ms": ttft, "chunks": chunks, "done_at": payloads[-1][0]}

    def _plain(self, body: dict) -> dict[str, Any]:
        r = self.client.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        return self.reply(r.json())

    def _stream(self, body: dict, t0: int) -> dict[str, Any]:
        payloads: list[tuple[int, bytes]] = []
        with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    payloads.append((time.perf_counter_ns(), line[6:].encode()))
                    if line == "data: [DONE]":
                        break  # the last event: the clock stops when it arrived
        return self.events(payloads, t0)

    def get(self, path: str) -> str:
        return self.client.get(path).text

    def close(self) -> None:
        self.client.close()


class RawHttp(Http):
    """The daemon over one keep-alive socket with HTTP/1.1 written by hand: the least work a client
    can do (a send, then recv until the reply is complete; JSON is parsed after the clock stops), so
    that what is measured is the daemon and the transport rather than the client library.
    httpx costs about 1 ms per request and 70 us per streamed chunk of its own CPU on this machine."""

    def __init__(self, url: str, turn_type: str = "side") -> None:
        super().__init__(url, turn_type)
        host, port = url.removeprefix("http://").split(":")
        self.host = f"{host}:{port}"
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def _recv(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the daemon closed the connection")
        self.buf += data

    def _until(self, sep: bytes) -> bytes:
        while (i := self.buf.find(sep)) < 0:
            self._recv()
        out, self.buf = self.buf[:i], self.buf[i + len(sep):]
        return out

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._recv()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _request(self, body: dict) -> dict[str, str]:
        data = json.dumps(body).encode()
        self.sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + self.host.encode() +
                          b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(data)).encode() +
                          b"\r\n\r\n" + data)
        status, *lines = self._until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        if status.split()[1] != "200":
            raise RuntimeError(f"daemon answered {status}")
        return {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}

    def _chunks(self) -> Any:
        """The body of a chunked reply, one HTTP chunk at a time, each with the time it arrived."""
        while True:
            size = int(self._until(b"\r\n").split(b";")[0], 16)
            data = self._exactly(size + 2)[:-2]
            if not size:
                return
            yield time.perf_counter_ns(), data

    def _plain(self, body: dict) -> dict[str, Any]:
        headers = self._request(body)
        if "content-length" in headers:
            raw = self._exactly(int(headers["content-length"]))
        else:
            raw = b"".join(data for _, data in self._chunks())
        return self.reply(json.loads(raw))

    def _stream(self, body: dict, t0: int) -> dict[str, Any]:
        self._request(body)
        received: list[tuple[int, bytes]] = []
        chunks = self._chunks()
        for at, data in chunks:
            received.append((at, data))
            if data.endswith(b"data: [DONE]\n\n"):
                break  # the last event: the clock stops when it arrived
        for _ in chunks:  # the terminating chunk
            pass
        payloads = []
        pending = b""
        for at, data in received:  # SSE events may in principle span HTTP chunks
            pending += data
            *events, pending = pending.split(b"\n\n")
            payloads += [(at, e[6:]) for e in events if e.startswith(b"data: ")]
        return self.events(payloads, t0)

    def close(self) -> None:
        self.sock.close()
        super().close()


# ---------------------------------------------------------------- the benchmark


def pick_prompts(direct: Direct, longest: int) -> list[list[dict]]:
    from clawback.chat import ChatRequest

    chosen = []
    for p in PROMPTS:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p}]
        req = ChatRequest.model_validate({"model": "clawback", "messages": messages})
        out = direct.run(req, longest)
        ok = out["completion_tokens"] == longest and not out["hit_eos"]
        print(f"  prompt {len(chosen)}: {out['prompt_tokens']} prompt tokens, greedy reply "
              f"{'runs past' if ok else 'ENDS BEFORE'} {longest} tokens", flush=True)
        if ok:
            chosen.append(messages)
    if not chosen:
        raise SystemExit(f"no candidate prompt generates {longest} tokens greedily; lower --max-tokens")
    return chosen


class LoadMeter:
    """CPU that *other* processes on the machine use, in cores (0 = quiet, 1 = a whole core taken)."""

    QUIET = 0.15

    def __init__(self, daemon_pid: int) -> None:
        self.daemon_pid = daemon_pid

    def snapshot(self) -> tuple[int, int, int]:
        return machine_busy_ns(), cpu_ns() + cpu_ns(self.daemon_pid), time.perf_counter_ns()

    def other_cores(self, since: tuple[int, int, int]) -> float:
        m, o, w = self.snapshot()
        other = (m - since[0]) - (o - since[1])
        return max(other, 0) / max(w - since[2], 1)

    def wait_quiet(self, max_s: float, window_s: float = 0.5) -> float:
        """Wait (at most max_s) for a window in which the rest of the machine is quiet; returns seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < max_s:
            snap = self.snapshot()
            time.sleep(window_s)
            if self.other_cores(snap) < self.QUIET:
                break
        return time.monotonic() - t0


def run_setting(direct: Direct, http: Http, daemon: Daemon, prompts: list[list[dict]], max_tokens: int,
                stream: bool, pairs: int, warmup: int, gap_s: float, quiet_wait_s: float) -> list[dict[str, Any]]:
    from clawback.chat import ChatRequest

    reqs = [ChatRequest.model_validate({"model": "clawback", "messages": m}) for m in prompts]
    rows: list[dict[str, Any]] = []
    meter = LoadMeter(daemon.proc.pid)
    label = f"max_tokens={max_tokens} {'stream' if stream else 'non-stream'}"
    waited = 0.0
    for i in range(-warmup, pairs):
        k = i % len(prompts)
        direct_first = i % 2 == 0
        if quiet_wait_s > 0 and i >= 0:
            waited += meter.wait_quiet(quiet_wait_s)
        snap = meter.snapshot()
        res: dict[str, dict] = {}
        for side in (("direct", "http") if direct_first else ("http", "direct")):
            if side == "direct":
                res["direct"] = direct.run(reqs[k], max_tokens)
            else:
                res["http"] = http.run(prompts[k], max_tokens, stream, daemon.proc.pid)
            time.sleep(gap_s)
        if i < 0:
            continue
        d, h = res["direct"], res["http"]
        rows.append({
            "pair": i, "prompt": k, "direct_first": direct_first,
            "direct_ms": d["total_ms"], "http_ms": h["total_ms"], "added_ms": h["total_ms"] - d["total_ms"],
            "direct_tokens": d["completion_tokens"], "http_tokens": h["completion_tokens"],
            "prompt_tokens": [d["prompt_tokens"], h["prompt_tokens"]],
            "same_text": d["text"] == h["text"], "finish_reason": h["finish_reason"],
            "direct_ttft_ms": d["ttft_ms"], "http_ttft_ms": h.get("ttft_ms"), "chunks": h.get("chunks"),
            "direct_step_ms_median": d["step_ms_median"], "direct_render_ms": d["render_ms"],
            "direct_cpu_ms": d["cpu_ms"], "daemon_cpu_ms": h["daemon_cpu_ms"], "client_cpu_ms": h["client_cpu_ms"],
            "call_id": h["call_id"], "other_cores": meter.other_cores(snap),
        })
        if (i + 1) % 10 == 0 or i == pairs - 1:
            added = [r["added_ms"] for r in rows]
            quiet = sum(r["other_cores"] < LoadMeter.QUIET for r in rows)
            print(f"  {label}: {i + 1}/{pairs} pairs ({quiet} quiet), added p50 so far {pct(added, 50):+.2f} ms"
                  + (f", waited {waited:.0f} s for quiet" if waited >= 1 else ""), flush=True)
    return rows


def analyse(rows: list[dict[str, Any]], timings: dict[str, dict[str, float]], max_tokens: int,
            stream: bool) -> dict[str, Any]:
    for r in rows:
        t = timings.get(r["call_id"] or "")
        if t:
            r["server_total_ms"] = t["total_s"] * 1e3
            r["server_render_ms"] = t["render_s"] * 1e3
            r["server_ttft_ms"] = t["ttft_s"] * 1e3
            r["outside_server_ms"] = r["http_ms"] - r["server_total_ms"]  # transport, routing, client
            r["inside_server_ms"] = r["server_total_ms"] - r["direct_ms"]  # validation, capture, detok...
    added = [r["added_ms"] for r in rows]
    d_tps = [r["direct_tokens"] / (r["direct_ms"] / 1e3) for r in rows]
    h_tps = [r["http_tokens"] / (r["http_ms"] / 1e3) for r in rows]
    out: dict[str, Any] = {
        "pairs": len(rows),
        "tokens_equal": all(r["direct_tokens"] == r["http_tokens"] for r in rows),
        "completion_tokens": sorted({r["http_tokens"] for r in rows} | {r["direct_tokens"] for r in rows}),
        "text_equal": sum(r["same_text"] for r in rows),
        "direct_ms": summary([r["direct_ms"] for r in rows]),
        "http_ms": summary([r["http_ms"] for r in rows]),
        "added_ms": summary(added),
        "added_p50_ci95": median_ci95(added),
        "added_p50_direct_first": pct([r["added_ms"] for r in rows if r["direct_first"]], 50),
        "added_p50_http_first": pct([r["added_ms"] for r in rows if not r["direct_first"]], 50),
        "added_pct_p50": 100 * pct(added, 50) / pct([r["direct_ms"] for r in rows], 50),
        "direct_tok_s_p50": pct(d_tps, 50),
        "http_tok_s_p50": pct(h_tps, 50),
        "throughput_ratio": pct(h_tps, 50) / pct(d_tps, 50),
        "direct_step_ms_p50": pct([r["direct_step_ms_median"] for r in rows if r["direct_step_ms_median"]], 50),
        "other_cores": statistics.fmean(r["other_cores"] for r in rows),
        "quiet_pairs": sum(r["other_cores"] < LoadMeter.QUIET for r in rows),
        "extra_cpu_ms": summary([r["daemon_cpu_ms"] + r["client_cpu_ms"] - r["direct_cpu_ms"] for r in rows]),
        "daemon_cpu_ms": summary([r["daemon_cpu_ms"] for r in rows]),
        "direct_cpu_ms": summary([r["direct_cpu_ms"] for r in rows]),
    }
    if all("server_total_ms" in r for r in rows):
        out["outside_server_ms"] = summary([r["outside_server_ms"] for r in rows])
        out["inside_server_ms"] = summary([r["inside_server_ms"] for r in rows])
        out["server_render_ms"] = summary([r["server_render_ms"] for r in rows])  # body read, validation, render
    if all("direct_render_ms" in r for r in rows):
        out["direct_render_ms"] = summary([r["direct_render_ms"] for r in rows])
    ttft = [r["http_ttft_ms"] - r["direct_ttft_ms"] for r in rows if r["http_ttft_ms"] is not None]
    if ttft:
        out["added_ttft_ms"] = summary(ttft)
    per_token = TARGET_STREAM_TOKEN_MS * max_tokens if stream else 0.0
    out["meets"] = {"p50": pct(added, 50) <= TARGET_P50_MS + per_token, "p99": pct(added, 99) <= TARGET_P99_MS + per_token,
                    "ratio": out["throughput_ratio"] >= TARGET_RATIO}
    return out


def fit_per_token(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per mode, added p50 = fixed + per_token * max_tokens (least squares over the settings)."""
    fits = {}
    for mode in sorted({r["mode"] for r in results}):
        pts = [(r["max_tokens"], r["stats"]["added_ms"]["p50"]) for r in results if r["mode"] == mode]
        if len({n for n, _ in pts}) < 2:
            continue
        mx, my = statistics.fmean(n for n, _ in pts), statistics.fmean(a for _, a in pts)
        slope = sum((n - mx) * (a - my) for n, a in pts) / sum((n - mx) ** 2 for n, _ in pts)
        fits[mode] = {"fixed_ms": my - slope * mx, "per_token_ms": slope}
    return fits


def print_table(results: list[dict[str, Any]]) -> None:
    head = (f"{'setting':<18} {'n':>3} {'tok':>4} {'direct p50':>10} {'http p50':>9} {'added p50':>9} "
            f"{'added p99':>9} {'ratio':>6} {'in-srv p50':>10} {'out-srv p50':>11} {'+cpu p50':>8} {'other':>5}  targets")
    print(head)
    print("-" * len(head))
    lines = [x for res in results for x in ([(res["setting"], res["stats"])] +
                                             ([("  quiet pairs", res["stats_quiet"])] if "stats_quiet" in res else []))]
    for setting, a in lines:
        tok = "/".join(map(str, a["completion_tokens"]))
        ins = a.get("inside_server_ms", {}).get("p50", float("nan"))
        outs = a.get("outside_server_ms", {}).get("p50", float("nan"))
        print(f"{setting:<18} {a['pairs']:>3} {tok:>4} {a['direct_ms']['p50']:>10.1f} {a['http_ms']['p50']:>9.1f} "
              f"{a['added_ms']['p50']:>+9.2f} {a['added_ms']['p99']:>+9.2f} {a['throughput_ratio']:>6.3f} "
              f"{ins:>+10.2f} {outs:>+11.2f} {a['extra_cpu_ms']['p50']:>+8.1f} {a['other_cores']:>5.2f}  "
              f"{'all met' if all(a['meets'].values()) else 'missed: ' + ', '.join(k for k, v in a['meets'].items() if not v)}")
    for setting, a in lines:
        lo, hi = a["added_p50_ci95"]
        print(f"  {setting:<16} added p50 95% CI [{lo:+.2f}, {hi:+.2f}] ms; by order: direct first "
              f"{a['added_p50_direct_first']:+.2f}, http first {a['added_p50_http_first']:+.2f}")
    print("(ms; added = http - direct per pair; ratio = median http tok/s / median direct tok/s; in-srv = daemon's own "
          "total_s - direct; out-srv = client time - daemon's total_s; +cpu = daemon+client CPU - direct CPU; other = cores "
          "busy with other processes on the machine, mean over the pairs, 0 = quiet; 'quiet pairs' = only the pairs with "
          f"other < {LoadMeter.QUIET})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help=f"model dir (default: the embedded model, {DEFAULT_MODEL}); 'tiny' = a 2-layer random Llama "
                         "with the same tokenizer, to resolve the overhead without the model's compute noise")
    ap.add_argument("--pairs", type=int, default=30, help="measured direct/http pairs per setting (default 30)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured pairs before each setting (default 3)")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[16, 64], help="settings (default 16 64)")
    ap.add_argument("--modes", nargs="+", choices=["plain", "stream"], default=["plain", "stream"],
                    help="non-streaming (plain) and/or streaming requests (default both)")
    ap.add_argument("--client", choices=["raw", "httpx"], default="raw",
                    help="HTTP client: a hand-written HTTP/1.1 client that does the least work (raw, default), or "
                         "httpx (adds its own ~1 ms per request)")
    ap.add_argument("--turn-type", choices=["side", "main"], default="side",
                    help="side (default): untagged calls, stored after the reply; main: an agent's own turns, "
                         "committed to the store before the reply ends (durability) and given the memory notes")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads on each side: torch.set_num_threads here, CLAWBACK_TORCH_THREADS for the daemon (default 1)")
    ap.add_argument("--device", default="auto", help="engine device on both sides (default auto)")
    ap.add_argument("--gap-ms", type=float, default=10.0,
                    help="pause after each request so the daemon's after-response work (store write) settles (default 10)")
    ap.add_argument("--quiet-wait", type=float, default=0.0,
                    help="before each pair, wait up to this many seconds for the rest of the machine to be quiet "
                         "(< 0.15 cores busy); for shared machines (default 0 = off)")
    ap.add_argument("--engine-steps", type=int, default=64, help="steps for the engine-only per-token timing (default 64)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results", help="where the JSON goes")
    ap.add_argument("--daemon-log-level", default="warning", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--daemon-wrapper", type=Path, default=None,
                    help="experiments only: start the daemon as `python WRAPPER serve ...` (a script that patches "
                         "something, then calls clawback.daemon.cli.main) instead of `python -m clawback.daemon.cli serve ...`")
    ap.add_argument("--keep-data", action="store_true", help="keep the daemon's temp data dir (its log and store)")
    args = ap.parse_args(argv)

    from clawback.chat import ChatRequest
    from clawback.daemon.models import ensure_embedded_model

    if args.model in (None, "tiny"):
        model_dir = ensure_embedded_model(DEFAULT_MODEL)
        if args.model == "tiny":
            model_dir = tiny_model(model_dir, Path(tempfile.gettempdir()) / "clawback-bench-tiny-llama")
    else:
        model_dir = Path(args.model).expanduser().resolve()
    started = dt.datetime.now().astimezone()
    print(f"serve_overhead: model {model_dir}, torch threads {args.threads} per side, {args.pairs} pairs per setting", flush=True)
    info = machine()
    daemon = BenchDaemon(model_dir, args.threads, args.device, args.daemon_log_level, args.daemon_wrapper)
    direct = http = None
    try:
        direct = Direct(model_dir, args.threads, args.device)  # loads while the daemon loads
        daemon.wait_ready()
        http = (RawHttp if args.client == "raw" else Http)(daemon.url, args.turn_type)
        print(f"daemon pid {daemon.proc.pid} at {daemon.url}; choosing prompts", flush=True)
        prompts = pick_prompts(direct, max(args.max_tokens))

        eng_ids = direct.renderer.render(ChatRequest.model_validate({"model": "clawback", "messages": prompts[0]}))[1]
        direct.engine_only(eng_ids, 8)  # warm
        eng = direct.engine_only(eng_ids, args.engine_steps)
        engine_only = {"prefill_ms": eng["prefill_ms"], "prompt_tokens": len(eng_ids),
                       "decode_step_ms": summary(eng["decode_step_ms"])}
        print(f"engine only: prefill {eng['prefill_ms']:.1f} ms ({len(eng_ids)} tokens), decode step p50 "
              f"{engine_only['decode_step_ms']['p50']:.2f} ms (p90 {engine_only['decode_step_ms']['p90']:.2f})", flush=True)

        settings_rows = []
        for n in args.max_tokens:
            for mode in args.modes:
                rows = run_setting(direct, http, daemon, prompts, n, mode == "stream", args.pairs, args.warmup,
                                   args.gap_ms / 1e3, args.quiet_wait)
                settings_rows.append((f"{n} {mode}", n, mode, rows))
        metrics = http.get("/metrics")
    finally:
        if http:
            http.close()
        daemon.stop()
        if direct:
            direct.close()

    timings = daemon.server_timings()
    results = []
    for name, n, mode, rows in settings_rows:
        res = {"setting": name, "max_tokens": n, "mode": mode, "stats": analyse(rows, timings, n, mode == "stream"), "rows": rows}
        quiet = [r for r in rows if r["other_cores"] < LoadMeter.QUIET]
        if len(rows) > len(quiet) >= 10:  # also the pairs during which nothing else ran on the machine
            res["stats_quiet"] = analyse(quiet, timings, n, mode == "stream")
        results.append(res)
    finished = dt.datetime.now().astimezone()
    print()
    print_table(results)
    fits = fit_per_token(results)
    for mode, f in fits.items():
        print(f"  {mode}: added p50 ~ {f['fixed_ms']:+.2f} ms + {f['per_token_ms'] * 1e3:+.1f} us per generated token")
    for res in results:
        a = res["stats"]
        if not a["tokens_equal"]:
            print(f"WARNING {res['setting']}: completion_tokens differ between the sides: {a['completion_tokens']}")
        if a["text_equal"] != a["pairs"]:
            print(f"note {res['setting']}: replies identical in {a['text_equal']}/{a['pairs']} pairs")

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"serve_overhead-{started.strftime('%Y%m%d-%H%M%S')}.json"
    report = {
        "started": started.isoformat(), "finished": finished.isoformat(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "client": args.client, "turn_type": args.turn_type, "daemon_command": daemon.cmd, "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "model_dir": str(model_dir), "machine": info, "loadavg_at_end": Path("/proc/loadavg").read_text().strip(),
        "targets": {"added_p50_ms": TARGET_P50_MS, "added_p99_ms": TARGET_P99_MS,
                    "added_per_streamed_token_ms": TARGET_STREAM_TOKEN_MS, "throughput_ratio": TARGET_RATIO},
        "engine_only": engine_only, "prompts": prompts, "added_fit": fits,
        "results": results,
        "daemon_dropped_or_errors": [ln for ln in metrics.splitlines() if ln.startswith(("clawback_store_dropped", "clawback_requests"))],
    }
    path.write_text(json.dumps(report, indent=1))
    print(f"\nwrote {path}")
    if args.keep_data:
        print(f"daemon data dir kept: {daemon.data_dir}")
    else:
        shutil.rmtree(daemon.data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
