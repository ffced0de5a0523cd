"""How many training steps of note consolidation it takes before the weights alone, with no note in
context, start a reply the way the note asked.

The simulator's 16-session cells train 1 to 3 steps, and with the notes off no version in any
cell put measurable mass on the wanted opener (the probe then read the top-20 first tokens only). This
runs the daemon's own trainer on consolidation samples, the way `daemon/samples.py` makes them,
for many more steps, and after each step reads the full-vocabulary probability of a wanted first
token with the note off, on the scenario's held-out tasks:

- served reply: greedy, from the base model with the note in the user message (`memory/user`, as
  the daemon injects it), which meets the preference; reward +1 (the person's 👍);
- student context: the same request without the note (`prompt_ids`), behaviour logprobs and the
  top-K ids' logprobs scored there by the policy being trained (the serving version, refreshed
  before each step); teacher: the base model with the note, sampled token and top-K (distill=True);
- one step per batch of `--batch` train tasks, cycling through them; `TrainConfig` defaults
  (combined, top-K 4, distill_weight 1) at `--lr`; with `--token-level` the teacher scores the
  reply's own tokens only (no top-K, so no distillation term), as the daemon teaches a liked reply;
- `--eval-told` also rates whole replies with the note in context (does the trained model overdo
  what the note asks when told it?).
- `--corrected`: corrections instead of liked replies. The served reply is the base model's greedy
  reply without the note (it misses the preference), rated −1 with the note as the correction's
  hint; it trains where it was served, against its teacher there plus the hint (`hint/user`, as
  the daemon appends a hint), top-K from the serving policy, no distillation. `--topk-until N`
  sets `TrainConfig.topk_until_nats` (top-K only up to where the reply left the teacher's path),
  `--penalty-until N` `TrainConfig.penalty_until_nats` (the −1 only up to there);
  `--method binary` trains the reward alone (no teacher term); `--teacher-top` takes the top-K
  ids from the teacher instead and distils them (what the teacher would have said where the
  reply diverged); `--evidence W` adds the teacher's own greedy reply under the hint as a row with
  advantage W plus the OPD term on its tokens (`TrainConfig.evidence_weight`; `--evidence-bonus-only`:
  W alone, as before the teacher's logprobs of its reply were kept; `--evidence-teacher base`: the
  base model given the hint writes and scores it, whatever `--teacher` is).

Simplifications against the daemon: the teacher is the base model with the note, where a
correction's teacher in the daemon is the serving version given the hint (`--teacher self`: the
policy being trained, given the note as the hint, scored again before each step); the served
replies are the base model's (the daemon's come from the version live at the time); and each
reply trains once per pass over the tasks, its behaviour logprobs scored again each time.

    python bench/consolidation_steps.py --scenario great --steps 12 --out bench/results/consolidation_steps_great.json
    python bench/consolidation_steps.py --scenario great --steps 8 --eval-at 0,8 --eval-told --token-level --out OUT.json
    python bench/consolidation_steps.py --scenario great --steps 8 --eval-at 0,8 --eval-told --corrected --topk-until 1 --out OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import time
from pathlib import Path

import torch


def main(args: argparse.Namespace) -> dict:
    from in_context_following import hint_of, told
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clawback.chat import ChatRenderer, ChatRequest
    from clawback.replies import repeats_a_sentence
    from clawback.sim.probe import opener_ids
    from clawback.sim.scenarios import SCENARIOS
    from clawback.trainer.config import TrainConfig
    from clawback.trainer.step import Sample, divergence_end, make_lora_model, make_optimizer, train_step

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    scen = SCENARIOS[args.scenario]
    assert scen.good_opener is not None, f"{args.scenario} has no opener rule"
    tok = AutoTokenizer.from_pretrained(str(args.model))
    renderer = ChatRenderer(tok)
    hint = hint_of(scen)
    cfg = TrainConfig(method=args.method, lr=args.lr, batch_size=args.batch, topk_until_nats=args.topk_until,
                      penalty_until_nats=args.penalty_until, evidence_weight=args.evidence)
    model = make_lora_model(AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32), cfg)
    opt = make_optimizer(model, cfg)
    good_ids = torch.tensor(opener_ids(tok, scen.name, scen.good_opener))

    def ids_of(messages: list[dict]) -> list[int]:
        return renderer.render(ChatRequest.model_validate({"model": "bench", "messages": messages}))[1]

    def plain(task) -> list[dict]:
        return [{"role": "user", "content": task.prompt}]

    @torch.inference_mode()
    def logprobs(prompt: list[int], response: list[int], teacher: bool = False) -> torch.Tensor:
        """log π over the vocabulary at each response position (the base model when `teacher`)."""
        ctx = model.disable_adapter() if teacher else contextlib.nullcontext()
        with ctx:
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        return logits.float().log_softmax(-1)

    @torch.inference_mode()
    def opener_mass(tasks) -> list[float]:
        """Full-vocabulary probability of a wanted first token, no note in context."""
        out = []
        for task in tasks:
            logits = model(input_ids=torch.tensor([ids_of(plain(task))])).logits[0, -1].float()
            out.append(logits.softmax(-1)[good_ids].sum().item())
        return out

    stops = [i for i in tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]) if i is not None]

    @torch.inference_mode()
    def greedy(prompts: list[list[int]], n: int, teacher: bool) -> list[tuple[list[int], bool]]:
        """Greedy replies, all prompts in one left-padded batch: (ids without the stop, stopped)."""
        width = max(map(len, prompts))
        ids = torch.tensor([[stops[0]] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with model.disable_adapter() if teacher else contextlib.nullcontext():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, eos_token_id=stops,
                                 pad_token_id=stops[0])
        replies = []
        for row in out[:, width:].tolist():
            end = next((i for i, t in enumerate(row) if t in stops), None)
            replies.append((row[:end] if end is not None else row, end is not None))
        return replies

    eval_at = {int(k) for k in args.eval_at.split(",") if k}
    train = list(scen.train[: args.tasks])
    held = list(scen.eval[: args.held_out])
    t0 = time.perf_counter()
    teacher_prompts = [ids_of(told(plain(task), hint, "hint/user" if args.corrected else "memory/user")) for task in train]
    # a liked reply is the told model's; a corrected one is the untold model's, which missed
    replies = greedy([ids_of(plain(t)) for t in train] if args.corrected else teacher_prompts, args.max_tokens,
                     teacher=True)
    served = [(ids_of(plain(task)), tp, reply) for task, tp, (reply, _) in zip(train, teacher_prompts, replies)]
    print(f"served {len(served)} replies in {time.perf_counter() - t0:.0f} s; first: {tok.decode(served[0][2])[:80]!r}",
          flush=True)
    teacher = [logprobs(tp, r, teacher=True) for _, tp, r in served] if args.teacher == "base" else []

    def sample(i: int, evidence: bool = True) -> Sample:
        student_prompt, teacher_prompt, reply = served[i]
        t_lp = teacher[i] if args.teacher == "base" else logprobs(teacher_prompt, reply)
        s_lp = logprobs(student_prompt, reply)
        resp = torch.tensor(reply)[:, None]
        behaviour, teacher_lp = s_lp.gather(1, resp)[:, 0].tolist(), t_lp.gather(1, resp)[:, 0].tolist()
        if args.corrected:  # trained where served: the serving policy's top-K, no distillation
            top_ids = (t_lp if args.teacher_top else s_lp).topk(cfg.opd_top_k, dim=-1).indices
            evidence_ids = evidence_lps = evidence_teacher = None
            if args.evidence and evidence:  # the teacher's own greedy reply, as the daemon's _evidence makes it
                base_writes = (args.evidence_teacher or args.teacher) == "base"
                (ids, stopped), = greedy([teacher_prompt], 2 * len(reply) + 32, teacher=base_writes)
                if stopped and ids:
                    evidence_ids, column = ids, torch.tensor(ids)[:, None]
                    evidence_lps = logprobs(student_prompt, ids).gather(1, column)[:, 0].tolist()
                    if not args.evidence_bonus_only:
                        evidence_teacher = logprobs(teacher_prompt, ids, teacher=base_writes).gather(
                            1, column)[:, 0].tolist()
            return Sample(student_prompt, reply, behaviour, -1.0, teacher_logprobs=teacher_lp, top_ids=top_ids.tolist(),
                          top_logprobs=s_lp.gather(1, top_ids).tolist(),
                          teacher_top_logprobs=t_lp.gather(1, top_ids).tolist(), evidence_ids=evidence_ids,
                          evidence_logprobs=evidence_lps, evidence_teacher_logprobs=evidence_teacher,
                          distill=args.teacher_top)
        if args.token_level:  # the reply's own tokens only: nothing it did not say is raised
            return Sample(student_prompt, reply, behaviour, 1.0, teacher_logprobs=teacher_lp)
        top_ids = t_lp.topk(cfg.opd_top_k, dim=-1).indices  # the serving policy (with the note) = the teacher here
        return Sample(student_prompt, reply, behaviour, 1.0, teacher_logprobs=teacher_lp, top_ids=top_ids.tolist(),
                      top_logprobs=s_lp.gather(1, top_ids).tolist(),
                      teacher_top_logprobs=t_lp.gather(1, top_ids).tolist(), distill=True)

    def point(step: int, metrics: dict | None) -> dict:
        mass = opener_mass(held)
        row = {"step": step, "mass_mean": sum(mass) / len(mass),
               "log10_mass_median": sorted(math.log10(max(m, 1e-30)) for m in mass)[len(mass) // 2],
               "metrics": metrics, "elapsed_s": round(time.perf_counter() - t0)}
        # Whole replies, without the note and with it: do they meet the preference, are they right,
        # and does training without the note make the told replies overdo it (say a sentence twice)?
        for key, with_note in (("no_note", False), ("note", True)):
            if step not in eval_at or with_note and not args.eval_told:
                continue
            got = greedy([ids_of(told(plain(t), hint, "memory/user") if with_note else plain(t)) for t in held],
                         args.eval_tokens, teacher=False)
            texts = [tok.decode(r, skip_special_tokens=True) for r, _ in got]
            ratings = [scen.rate(text, t, stopped) for text, t, (_, stopped) in zip(texts, held, got)]
            row[key] = {"meets": sum(r.meets for r in ratings) / len(held),
                        "right": sum(r.right for r in ratings) / len(held),
                        "cut": sum(r.gate == "cut" for r in ratings),
                        "repeat": sum(repeats_a_sentence(text) for text in texts), "replies": texts}
        print(json.dumps({k: v for k, v in row.items() if k not in ("metrics", "no_note", "note")}
                         | {key: {k: v for k, v in row[key].items() if k != "replies"} for key in ("no_note", "note")
                            if key in row}), flush=True)
        return row

    # where each corrected reply left the teacher's path (1 nat), before any training
    diverged_at = [divergence_end(sample(i, evidence=False), 1.0) - 1 for i in range(len(served))] if args.corrected else None
    curve = [point(0, None)]
    for step in range(1, args.steps + 1):
        batch = [sample(((step - 1) * args.batch + j) % len(served)) for j in range(args.batch)]
        metrics = train_step(model, opt, batch, cfg)
        curve.append(point(step, {k: metrics[k] for k in ("loss", "grad_norm", "topk_adv", "adv", "evidence_rows") if k in metrics}))
    return {"scenario": args.scenario, "model": str(args.model), "lr": args.lr, "batch": args.batch,
            "method": args.method, "token_level": args.token_level, "corrected": args.corrected,
            "topk_until": args.topk_until, "penalty_until": args.penalty_until, "teacher": args.teacher,
            "teacher_top": args.teacher_top, "evidence": args.evidence, "evidence_bonus_only": args.evidence_bonus_only,
            "evidence_teacher": args.evidence_teacher or args.teacher,
            "diverged_at": diverged_at,
            "tasks": len(train), "held_out": len(held), "hint": hint, "train_config": dataclasses.asdict(cfg), "curve": curve}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path.home() / ".clawback" / "models" / "qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--scenario", default="great")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--held-out", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--eval-at", default="0,4,8", help="steps after which whole no-note replies are rated")
    ap.add_argument("--eval-tokens", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--token-level", action="store_true",
                    help="train on the reply's own tokens only (no top-K teacher, no distillation term)")
    ap.add_argument("--eval-told", action="store_true", help="also rate whole replies with the note in context")
    ap.add_argument("--corrected", action="store_true",
                    help="train on corrected replies (the untold reply, rated -1, the note as the hint)")
    ap.add_argument("--method", default="combined", choices=("combined", "binary", "opd"))
    ap.add_argument("--topk-until", type=float, default=None,
                    help="TrainConfig.topk_until_nats (default: top-K at every position)")
    ap.add_argument("--penalty-until", type=float, default=None,
                    help="TrainConfig.penalty_until_nats (default: a correction's -1 on every token)")
    ap.add_argument("--teacher", default="base", choices=("base", "self"),
                    help="the base model with the note, or the policy being trained with it (a correction's in the daemon)")
    ap.add_argument("--teacher-top", action="store_true",
                    help="--corrected: the teacher's top-K ids, distilled, instead of the serving policy's")
    ap.add_argument("--evidence", type=float, default=0.0,
                    help="--corrected: TrainConfig.evidence_weight (the teacher's greedy reply as a row)")
    ap.add_argument("--evidence-teacher", choices=("base", "self"), default=None,
                    help="--evidence: who writes (and scores) the evidence reply under the hint (default: --teacher)")
    ap.add_argument("--evidence-bonus-only", action="store_true",
                    help="--evidence: the row without its OPD term (the teacher's logprobs of its reply unknown)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    result = main(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
