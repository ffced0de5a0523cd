"""Tokens/s of clawback's training step versus a plain PEFT + transformers loop on the same batch.

Both sides train the same LoRA model with the same loss (`losses.policy_loss`) on the same
samples and take one AdamW step. They differ only in how the batch reaches the model:

  plain     micro-batches of a fixed number of samples in arrival order, right-padded, logits and
            log_softmax over every position, response tokens picked out afterwards
  clawback  `step.train_step`: samples sorted into micro-batches by a padded-token budget,
            logits only at response positions, logp = logit − logsumexp

Runs alternate (order flipped every pair) so machine noise hits both sides alike.

    .venv/bin/python bench/train_throughput.py                          # SmolLM2-135M, mixed lengths
    .venv/bin/python bench/train_throughput.py --lengths uniform --pairs 3 --threads 2

Prints a table and writes bench/results/train_throughput-<timestamp>.json (raw runs included).
Target (issue 4): ratio >= 1.0, >= 1.5 on mixed lengths.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = Path.home() / ".cache" / "clawback" / "models" / "smollm2-135m-instruct"
sys.path.insert(0, str(REPO))

from clawback.trainer.config import TrainConfig  # noqa: E402
from clawback.trainer.losses import advantages, policy_loss  # noqa: E402
from clawback.trainer.step import Sample, make_lora_model, make_optimizer, train_step  # noqa: E402


def make_samples(n: int, lengths: str, vocab: int, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if lengths == "mixed":  # agent traffic: prompts and replies of very different sizes
            P, R = rng.randint(16, 512), rng.randint(8, 128)
        else:
            P, R = 256, 64
        out.append(Sample(
            prompt_ids=[rng.randrange(3, vocab) for _ in range(P)],
            response_ids=[rng.randrange(3, vocab) for _ in range(R)],
            behaviour_logprobs=[-rng.uniform(0.1, 8.0) for _ in range(R)],
            reward=rng.choice([-1.0, 1.0]),
        ))
    return out


def plain_step(model, opt, samples: list[Sample], cfg: TrainConfig, per_micro: int) -> dict[str, float]:
    t0 = time.perf_counter()
    model.train()
    opt.zero_grad(set_to_none=True)
    n, tokens = len(samples), 0
    for i in range(0, n, per_micro):
        group = samples[i : i + per_micro]
        L = max(len(s.prompt_ids) + len(s.response_ids) for s in group)
        ids = torch.zeros(len(group), L, dtype=torch.long)
        attn = torch.zeros_like(ids)
        resp = torch.zeros(len(group), L - 1)  # 1 where position t predicts a response token
        behaviour = torch.zeros(len(group), L - 1)
        for j, s in enumerate(group):
            seq = list(s.prompt_ids) + list(s.response_ids)
            ids[j, : len(seq)] = torch.tensor(seq)
            attn[j, : len(seq)] = 1
            P, R = len(s.prompt_ids), len(s.response_ids)
            resp[j, P - 1 : P - 1 + R] = 1
            behaviour[j, P - 1 : P - 1 + R] = torch.tensor(s.behaviour_logprobs)
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        reward = torch.tensor([s.reward for s in group])
        adv = advantages(reward[:, None] * resp, behaviour, behaviour, resp, w_binary=1.0, w_opd=0.0)
        loss, _ = policy_loss(logp, logp.detach(), behaviour, adv, resp, tis_cap=cfg.tis_cap)
        (loss * len(group) / n).backward()
        tokens += int(attn.sum())
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.max_grad_norm)
    opt.step()
    elapsed = time.perf_counter() - t0
    return {"step_time_s": elapsed, "tokens_per_s": tokens / elapsed, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--lengths", choices=["mixed", "uniform"], default="mixed")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--plain-micro-batch", type=int, default=4, help="samples per micro-batch on the plain side")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(method="binary", micro_batch_tokens=args.micro_batch_tokens)
    model = make_lora_model(AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32), cfg)
    opt = make_optimizer(model, cfg)
    samples = make_samples(args.samples, args.lengths, model.config.vocab_size, seed=0)
    sides = {
        "plain": lambda: plain_step(model, opt, samples, cfg, args.plain_micro_batch),
        "clawback": lambda: train_step(model, opt, samples, cfg),
    }
    sides["plain"](), sides["clawback"]()  # warm-up, not recorded
    runs = []
    for i in range(args.pairs):
        for name in (["plain", "clawback"] if i % 2 == 0 else ["clawback", "plain"]):
            m = sides[name]()
            runs.append({"pair": i, "side": name, **{k: m[k] for k in ("step_time_s", "tokens_per_s", "tokens")}})
            print(f"  pair {i} {name:8s} {m['step_time_s']:7.2f} s  {m['tokens_per_s']:8.1f} tok/s", flush=True)

    tps = {s: statistics.median(r["tokens_per_s"] for r in runs if r["side"] == s) for s in sides}
    ratios = [
        next(r for r in runs if r["pair"] == i and r["side"] == "clawback")["tokens_per_s"]
        / next(r for r in runs if r["pair"] == i and r["side"] == "plain")["tokens_per_s"]
        for i in range(args.pairs)
    ]
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()},
        "median_tokens_per_s": tps,
        "ratio_per_pair": ratios,
        "median_ratio": statistics.median(ratios),
        "runs": runs,
    }
    print(f"\n{args.model.name}, {args.samples} samples ({args.lengths}), {args.pairs} pairs")
    print(f"  plain     {tps['plain']:8.1f} tok/s (median)")
    print(f"  clawback  {tps['clawback']:8.1f} tok/s (median)")
    print(f"  ratio     {result['median_ratio']:.2f} (median of per-pair ratios; target >= 1.0, >= 1.5 mixed)")
    out = REPO / "bench" / "results" / f"train_throughput-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"  wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main()
