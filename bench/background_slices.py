"""What the idle width of background chunks buys: a gate review's work on an idle embedded engine,
with prefill and scoring chunks of BACKGROUND_TOKENS (16, the width while requests come) against
BACKGROUND_IDLE_TOKENS (the width once none has come for BACKGROUND_IDLE_S).

The work is a review's three parts, made the way the gate makes them: greedy probe replies
(`--probes` of the gate's probes, 32 tokens), greedy replies to a person's requests (`--requests`
math questions under a long system note, 64 tokens), and scoring passes of stored replies
(`--scores` of the requests' own replies with the prompt, as the replay scores them). Each round
runs both widths, in alternating order; the medians over rounds and their ratio are the result.
Also: whether the greedy replies are the same token for token at both widths, the largest
difference of a scored logprob, and one forward of each width (what a request that arrives
during such a slice waits at most). Results: bench/README.md ("Background chunks when idle").

    python bench/background_slices.py --model ~/.clawback/models/qwen2.5-coder-0.5b-instruct --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import torch

NOTE = ("You are a helpful assistant. The person you help has asked, about every reply: start with "
        "'Sure!', write the work out in plain sentences with the numbers, no lists, no LaTeX, and end "
        "with the result and its unit. ") * 3


async def main(args: argparse.Namespace) -> dict:
    from _common import write_result
    from transformers import AutoTokenizer

    from clawback.chat import ChatRenderer, ChatRequest
    from clawback.daemon.probes import load_probes
    from clawback.engine import Sampling
    from clawback.engines import embedded
    from clawback.sim.tasks import PROBLEMS

    tok = AutoTokenizer.from_pretrained(str(args.model))
    renderer = ChatRenderer(tok)
    engine = embedded.EmbeddedEngine(args.model, device="cpu", torch_threads=args.threads)
    eos = engine.info.eos_token_ids

    def render(messages: list[dict], tools: tuple = ()) -> list[int]:
        req = ChatRequest.model_validate({"model": "bench", "messages": messages, **({"tools": list(tools)} if tools else {})})
        return renderer.render(req)[1]

    probes = [render([{"role": "user", "content": p.prompt}], p.tools) for p in load_probes()[: args.probes]]
    requests = [render([{"role": "system", "content": NOTE}, {"role": "user", "content": p.question}])
                for p in PROBLEMS[: args.requests]]

    async def greedy(ids: list[int], max_tokens: int) -> list[int]:
        sampling = Sampling(temperature=0.0, max_tokens=max_tokens, stop_token_ids=eos)
        return [t.id async for t in engine.generate(ids, sampling, background=True)]

    replies = await asyncio.gather(*(greedy(r, 128) for r in requests))  # the stored replies the replay scores
    scored = [(r, reply) for r, reply in zip(requests, replies) if reply][: args.scores]

    async def review(width: int) -> tuple[dict[str, float], list[list[int]], list[list[float]]]:
        embedded.BACKGROUND_IDLE_TOKENS = width
        seconds, t = {}, time.perf_counter()
        outs = await asyncio.gather(*(greedy(p, 32) for p in probes))
        seconds["probes"], t = time.perf_counter() - t, time.perf_counter()
        outs += await asyncio.gather(*(greedy(r, 64) for r in requests))
        seconds["requests"], t = time.perf_counter() - t, time.perf_counter()
        scores = [await engine.score(p, reply) for p, reply in scored]
        seconds["scores"] = time.perf_counter() - t
        seconds["review"] = sum(seconds.values())
        return seconds, outs, scores

    widths = (embedded.BACKGROUND_TOKENS, embedded.BACKGROUND_IDLE_TOKENS)
    rounds: list[dict[int, dict[str, float]]] = []
    first: dict[int, tuple[list[list[int]], list[list[float]]]] = {}
    for i in range(args.rounds):
        got = {}
        for width in widths if i % 2 == 0 else widths[::-1]:
            got[width], outs, scores = await review(width)
            first.setdefault(width, (outs, scores))
            print(f"round {i} width {width}: " + ", ".join(f"{k} {v:.1f} s" for k, v in got[width].items()), flush=True)
        rounds.append(got)

    narrow, wide = widths
    same = [a == b for a, b in zip(first[narrow][0], first[wide][0])]
    dlogp = max(abs(a - b) for s, w in zip(first[narrow][1], first[wide][1]) for a, b in zip(s, w))
    forward_s = {}
    with torch.inference_mode():
        ids = torch.tensor([requests[0] * 2])[:, : 200 + wide]
        for width in widths:
            times = []
            for _ in range(5):
                cache = embedded.Cache(layer_class_to_replicate=embedded.KVLayer)
                engine.model(input_ids=ids[:, :200], past_key_values=cache, use_cache=True)
                t = time.perf_counter()
                engine.model(input_ids=ids[:, 200 : 200 + width], past_key_values=cache, use_cache=True, logits_to_keep=1)
                times.append(time.perf_counter() - t)
            forward_s[width] = statistics.median(times)
    await engine.close()
    median = {w: {k: statistics.median(r[w][k] for r in rounds) for k in rounds[0][w]} for w in widths}
    result = {
        "model": str(args.model), "threads": args.threads, "rounds": rounds, "median_s": median,
        "ratio_review": median[narrow]["review"] / median[wide]["review"],
        "work": {"probes": len(probes), "requests": len(requests), "scores": len(scored),
                 "score_tokens": [len(p) + len(r) for p, r in scored]},
        "same_greedy_replies": f"{sum(same)} of {len(same)}", "max_abs_logprob_diff": dlogp,
        "forward_s_after_200_tokens": forward_s,
    }
    print({k: result[k] for k in ("median_s", "ratio_review", "same_greedy_replies", "max_abs_logprob_diff",
                                  "forward_s_after_200_tokens")})
    write_result("background_slices", result)
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path.home() / ".clawback" / "models" / "qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probes", type=int, default=24)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--scores", type=int, default=8)
    asyncio.run(main(ap.parse_args()))
