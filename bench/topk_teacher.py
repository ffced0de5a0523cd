"""What the teacher's view of the policy's top-K (top-K OPD) costs per sample, two ways.

A top-K sample needs, at every response position t, the teacher's logprobs of the K ids the
policy ranked highest when it served the call (recorded at serve time): the hinted request plus
response[:t] run through the policy. Two places can compute that:

* the serving engine, through its own API (what the daemon does): `engine.score_candidates` on
  vLLM-CPU (one `prompt_logprobs=20` request, then one `logprob_token_ids` request per position
  whose candidates are not all in the teacher's top 20; see daemon/engines/vllm.py), next to
  `engine.score` (the token-level teacher every OPD sample already pays for) on the same server;
* the trainer's process, which holds the policy: one forward pass of the hinted context and the
  response through the trainer's own PEFT model (LoRA as the trainer builds it), gathering the K
  ids' log-softmax at the response positions. Timed here in this process.

The embedded engine's `score_candidates` (the daemon-process path on CPU) is timed as well.

Each sample is a real reply: the 135M model's greedy reply (temperature 1 sampled, seeded) to a
chat request, with its top-K; the teacher prompt is that request with a hint. All paths score the
same ids and their results are compared (max |diff|). Interleaved over `--rounds`, median wall
time per sample; machine load is recorded because this 2-core machine is shared.

    .venv/bin/python bench/topk_teacher.py                       # SmolLM2-135M, 64 and 160 tokens
    .venv/bin/python bench/topk_teacher.py --lengths 64 --rounds 3

Writes bench/results/topk_teacher-<timestamp>.json. See bench/README.md, "Top-K teacher".
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import DEFAULT_MODEL, write_result

REQUEST = {"model": "clawback", "messages": [
    {"role": "system", "content": "You are a helpful assistant. Answer the user's question."},
    {"role": "user", "content": "Explain why the sky is blue, and why sunsets are red, to a curious ten-year-old."}]}
HINT = "Use one everyday comparison and keep it under five sentences."


def trainer_view(model: Any, prompt: list[int], response: list[int], candidates: list[list[int]]) -> list[list[float]]:
    """One forward pass in the trainer's process: the K ids' logprobs at each response position."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids, logits_to_keep=len(response) + 1).logits[0, :-1].float()
        lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(candidates))
    return lp.tolist()


def covered(model: Any, prompt: list[int], response: list[int], candidates: list[list[int]], top: int) -> float:
    """Share of positions whose candidates are all among the teacher's `top` most likely ids:
    the positions vLLM's one `prompt_logprobs` request answers."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response]), logits_to_keep=len(response) + 1).logits[0, :-1]
    best = logits.topk(top, dim=-1).indices.tolist()
    return sum(set(c) <= set(b) for c, b in zip(candidates, best)) / len(response)


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clawback.adapter_format import lora_target_modules
    from clawback.chat import ChatRenderer, ChatRequest
    from clawback.daemon.config import Settings
    from clawback.daemon.samples import teacher_messages
    from clawback.engine import Sampling
    from clawback.engines import build_engine
    from clawback.engines.embedded import EmbeddedEngine
    from clawback.engines.vllm import PROMPT_TOP_LOGPROBS

    model_dir = Path(args.model)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(model_dir)))
    _, prompt = renderer.render(ChatRequest.model_validate(REQUEST))
    _, teacher = renderer.render(ChatRequest.model_validate(
        {**REQUEST, "messages": teacher_messages(REQUEST["messages"], HINT)}))

    embedded = EmbeddedEngine(model_dir, device="cpu", dtype="float32", torch_threads=args.threads)
    samples = []
    for n in args.lengths:
        sampling = Sampling(temperature=1.0, max_tokens=n, seed=7, top_logprobs=args.k)
        toks = [t async for t in embedded.generate(prompt, sampling)]
        samples.append(([t.id for t in toks], [list(t.top_ids) for t in toks]))

    torch.set_num_threads(args.threads)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=lora_target_modules(model_dir)))
    policy.eval()

    coverage = {n: covered(policy, teacher, ids, top, PROMPT_TOP_LOGPROBS) for n, (ids, top) in zip(args.lengths, samples)}
    data = Path(tempfile.mkdtemp(prefix="topk-teacher-"))
    settings = Settings(data_dir=data, engine="vllm", dtype="float32", train={"lora_rank": 16},
                        engine_start_timeout_s=900, **({"engine_python": args.vllm_python} if args.vllm_python else {}))
    vllm = build_engine(settings.engine_config(), str(model_dir))
    t0 = time.perf_counter()
    await vllm.start()
    started_s = time.perf_counter() - t0
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in args.lengths} for k in
                                                ("vllm_score", "vllm_candidates", "trainer_forward",
                                                 "embedded_candidates")}
    diffs: dict[str, float] = {}
    try:
        for _ in range(args.rounds):
            for n, (ids, top) in zip(args.lengths, samples):
                t = time.perf_counter()
                await vllm.score(teacher, ids)
                times["vllm_score"][n].append(time.perf_counter() - t)
                t = time.perf_counter()
                by_vllm = await vllm.score_candidates(teacher, ids, top)
                times["vllm_candidates"][n].append(time.perf_counter() - t)
                t = time.perf_counter()
                by_trainer = await asyncio.to_thread(trainer_view, policy, teacher, ids, top)
                times["trainer_forward"][n].append(time.perf_counter() - t)
                t = time.perf_counter()
                by_embedded = await embedded.score_candidates(teacher, ids, top)
                times["embedded_candidates"][n].append(time.perf_counter() - t)
                diffs[f"vllm_vs_trainer[{n}]"] = max_diff(by_vllm, by_trainer)
                diffs[f"vllm_vs_embedded[{n}]"] = max_diff(by_vllm, by_embedded)
    finally:
        await vllm.close()
        await embedded.close()
    medians = {k: {n: statistics.median(v) for n, v in per.items()} for k, per in times.items()}
    return {"model": model_dir.name, "k": args.k, "prompt_tokens": len(prompt), "teacher_prompt_tokens": len(teacher),
            "lengths": args.lengths, "rounds": args.rounds, "threads": args.threads, "vllm_start_s": started_s,
            "median_s": medians, "times_s": times, "max_abs_diff": diffs, "prompt_top_logprobs_coverage": coverage,
            "loadavg_at_end": Path("/proc/loadavg").read_text().strip()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(DEFAULT_MODEL))
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 160])
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--vllm-python", default=None)
    args = p.parse_args()
    record = {"args": vars(args), **asyncio.run(main_async(args))}
    write_result("topk_teacher", record)
    print(f"teacher prompt {record['teacher_prompt_tokens']} tokens, K={args.k}; median seconds per sample:")
    for what, per in record["median_s"].items():
        print(f"  {what:22s} " + "  ".join(f"{n} tokens: {s:7.3f}" for n, s in per.items()))
    print("max |diff|:", {k: f"{v:.1e}" for k, v in record["max_abs_diff"].items()})
    print("positions answered by prompt_logprobs:", record["prompt_top_logprobs_coverage"])


if __name__ == "__main__":
    main()
