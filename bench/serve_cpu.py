"""How much CPU does the daemon's own request handling cost, per request and per streamed token?

The latency `serve_overhead.py` measures depends on whatever else runs on the machine: on 2
shared cores at load 5-10 its added p50 moves by several ms from run to run. CPU time spent on the
event loop's thread does not, so this measures that, in one process and without sockets:

* the daemon's ASGI app (`server.daemon_app`, tiny model, store, capture, metrics: everything
  `clawback serve` runs) is called directly with a POST /v1/chat/completions request;
* the engine replays tokens the real engine sampled for the same prompt once, yielding to the
  event loop after each token as the real one does, so only the daemon's work around the engine
  is measured;
* the direct side does what a program calling the engine itself must do: render the request to
  prompt ids, take the same tokens, decode the reply once.

Both sides run interleaved, `--rounds` times `--requests` requests per setting; the result is the
median over rounds of event-loop-thread CPU per request (`time.thread_time`). Settings: 16 and 64
tokens, non-streaming and streamed, side calls (untagged) and main calls (an agent's turns: also
session pairing, memory notes and the commit the reply waits for; the commit is the store writer
thread's CPU, not counted).

    .venv/bin/python bench/serve_cpu.py                 # 5 rounds x 200 requests per setting
    .venv/bin/python bench/serve_cpu.py --rounds 9

Prints a table and writes bench/results/serve_cpu-<timestamp>.json. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import DEFAULT_MODEL, tiny_model, write_result

PROMPT = [{"role": "system", "content": "You are a helpful assistant."},
          {"role": "user", "content": "Write a long, detailed story about a lighthouse keeper who finds a message in a bottle."}]


def request(n: int, stream: bool, main: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "clawback", "messages": PROMPT, "temperature": 0, "max_tokens": n}
    if stream:
        body["stream"], body["stream_options"] = True, {"include_usage": True}
    if main:
        body["turn_type"], body["session_id"] = "main", "bench"
    return body


class Bench:
    def __init__(self, model_dir: Path, longest: int) -> None:
        from clawback.chat import ChatRequest
        from clawback.daemon.config import Settings
        from clawback.daemon.server import build_state, daemon_app

        self.settings = Settings(model=str(model_dir), data_dir=Path(tempfile.mkdtemp(prefix="clawback-bench-")),
                                 no_auth=True, torch_threads=1)
        self.state = build_state(self.settings)
        self.app = daemon_app(self.settings, self.state)
        self.loop = asyncio.new_event_loop()
        req = ChatRequest.model_validate(request(longest, False, False))
        self.tokens = self.loop.run_until_complete(self._sample(req, longest))
        self.state.engine.generate = self._replay  # type: ignore[method-assign]

    async def _sample(self, req: Any, n: int) -> list[Any]:
        from clawback.engine import Sampling

        _, ids = self.state.renderer.render(req)
        sampling = Sampling(temperature=0.0, top_p=1.0, max_tokens=n, stop_token_ids=[])  # exactly n tokens
        return [t async for t in self.state.engine.generate(ids, sampling)]

    async def _replay(self, prompt_ids: Any, sampling: Any, adapter: Any = None, **_: Any) -> Any:
        for tok in self.tokens[:sampling.max_tokens]:
            await asyncio.sleep(0)  # the real engine hands each token over through the loop
            yield tok

    async def http(self, raw: bytes) -> bytes:
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/chat/completions",
                 "raw_path": b"/v1/chat/completions", "root_path": "", "query_string": b"",
                 "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                             (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
        pending = [{"type": "http.request", "body": raw, "more_body": False}]
        done = asyncio.Event()
        sent: list[bytes] = []

        async def receive() -> dict[str, Any]:
            if pending:
                return pending.pop()
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                assert message["status"] == 200, message
            sent.append(message.get("body", b""))
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        await self.app(scope, receive, send)
        return b"".join(sent)

    async def direct(self, body: dict[str, Any]) -> str:
        from clawback.chat import ChatRequest
        from clawback.engine import Sampling

        _, ids = self.state.renderer.render(ChatRequest.model_validate(body))
        sampling = Sampling(temperature=0.0, top_p=1.0, max_tokens=body["max_tokens"], stop_token_ids=[])
        out = [t.id async for t in self._replay(ids, sampling)]
        return self.state.renderer.tokenizer.decode(out, skip_special_tokens=True)

    def cpu_per_request(self, fn: Any, arg: Any, n: int) -> float:
        async def many() -> None:
            for _ in range(n):
                await fn(arg)
        c0 = time.thread_time()
        self.loop.run_until_complete(many())
        return (time.thread_time() - c0) / n * 1e6

    def close(self) -> None:
        self.state.store.flush()
        self.loop.run_until_complete(self.state.engine.close())
        self.state.store.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=200, help="requests per side, setting and round")
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[16, 64])
    args = ap.parse_args()

    from clawback.daemon.models import ensure_embedded_model

    model_dir = tiny_model(ensure_embedded_model(DEFAULT_MODEL), Path(tempfile.gettempdir()) / "clawback-bench-tiny-llama")
    bench = Bench(model_dir, max(args.max_tokens))
    settings = [(n, stream, main) for main in (False, True) for stream in (False, True) for n in args.max_tokens]
    rows: dict[str, dict[str, list[float]]] = {}
    try:
        for n, stream, main in settings:  # warm-up, and the replies are checked once
            body = request(n, stream, main)
            reply = bench.loop.run_until_complete(bench.http(json.dumps(body).encode()))
            text = bench.loop.run_until_complete(bench.direct(body))
            if stream:
                events = [json.loads(e[6:]) for e in reply.decode().split("\n\n") if e.startswith("data: {")]
                got = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            else:
                got = json.loads(reply)["choices"][0]["message"]["content"]
            assert got == text, (n, stream, main, got, text)
        for r in range(args.rounds):
            for n, stream, main in settings:
                body = request(n, stream, main)
                key = f"{n} {'stream' if stream else 'plain'} {'main' if main else 'side'}"
                row = rows.setdefault(key, {"daemon": [], "direct": []})
                sides = [("daemon", bench.http, json.dumps(body).encode()), ("direct", bench.direct, body)]
                for side, fn, arg in (sides if r % 2 == 0 else sides[::-1]):
                    row[side].append(bench.cpu_per_request(fn, arg, args.requests))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        bench.close()

    print(f"\n{'setting':<20} {'daemon us':>10} {'direct us':>10} {'added us':>9}   (event-loop thread CPU per request, median of {args.rounds} rounds)")
    summary: dict[str, Any] = {}
    for key, row in rows.items():
        d, e = statistics.median(row["daemon"]), statistics.median(row["direct"])
        added = statistics.median([a - b for a, b in zip(row["daemon"], row["direct"])])
        summary[key] = {"daemon_us": d, "direct_us": e, "added_us": added, "rounds": row}
        print(f"{key:<20} {d:>10.0f} {e:>10.0f} {added:>+9.0f}")
    for kind in ("side", "main"):
        for mode in ("plain", "stream"):
            lo, hi = min(args.max_tokens), max(args.max_tokens)
            if lo == hi:
                continue
            slope = (summary[f"{hi} {mode} {kind}"]["added_us"] - summary[f"{lo} {mode} {kind}"]["added_us"]) / (hi - lo)
            fixed = summary[f"{lo} {mode} {kind}"]["added_us"] - slope * lo
            summary[f"fit {mode} {kind}"] = {"fixed_us": fixed, "per_token_us": slope}
            print(f"  {mode} {kind}: added ~ {fixed:.0f} us + {slope:.1f} us per token")
    import clawback.daemon

    write_result("serve_cpu", {"command": " ".join([Path(sys.executable).name, *sys.argv]),
                               "daemon_source": str(Path(clawback.daemon.__file__).parent),
                               "loadavg_at_end": Path("/proc/loadavg").read_text().strip(),
                               "args": vars(args), "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
