"""Does the hinted teacher push down a loop's repeat? If it did, OPD alone would train against loops.

For every reply in simulator cells that contains a repetition loop (`repetition_loop`: a 6-token run
said 3 times), scores the reply's tokens on the embedded model (no adapter) under the context the
policy saw (the task with the cell's preference notes appended, as `memory.inject` does) and under
the teacher's (the same plus the simulated person's correction as the hint, `teacher_messages`),
and prints, per reply, the mean teacher − policy logprob gap over the prefix, over the loop's
first repeat ([loop_from, loop_to), what a loop sample trains against) and at its first token.
A negative gap on the repeat would mean the teacher disfavours it.

Approximations, stated: the notes are the cell's notes at its end (a reply may have been served
with fewer), the reply is re-tokenised from its text, and the adapter the reply came from is not
loaded. Usage:

    python bench/loop_teacher.py bench/results/strict/cells/sure/default/*.json ...
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from clawback.daemon import memory
from clawback.daemon.config import EMBEDDED_MODEL, Settings
from clawback.daemon.models import resolve_model
from clawback.daemon.samples import repetition_loop, teacher_messages
from clawback.sim.scenarios import SCENARIOS
from clawback.sim.user import SimulatedUser


def main(paths: list[str]) -> None:
    torch.set_num_threads(1)
    path = resolve_model(EMBEDDED_MODEL, Settings().models_dir)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()

    def logprobs(messages: list[dict], reply: str) -> tuple[list[int], list[float]]:
        prompt = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]
        ids = tok(reply, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logp_L_V = model(torch.tensor([prompt + ids])).logits[0].float().log_softmax(-1)
        return ids, [float(logp_L_V[len(prompt) + i - 1, t]) for i, t in enumerate(ids)]

    at_repeat = []
    for p in paths:
        cell = json.loads(Path(p).read_text())
        scenario = SCENARIOS[cell["cell"]["scenario"]]
        user = SimulatedUser(scenario, cell["cell"]["seed"], len(cell["interactions"]), 0.5, 0.0)
        notes = [n["text"] for n in cell["memory_notes"]]
        for it in cell["interactions"]:
            task, reply = user.tasks[it["i"]], it["reply"]
            policy = memory.inject([{"role": "user", "content": task.prompt}], notes)
            ids, student = logprobs(policy, reply)
            loop = repetition_loop(ids)
            if loop is None:
                continue
            rating = scenario.rate(reply, task)
            if rating.meets:  # no correction, so no teacher
                continue
            hint = scenario.correction(rating)
            _, teacher = logprobs(teacher_messages(policy, hint), reply)
            gap = [t - s for t, s in zip(teacher, student)]
            a, b = loop
            at_repeat.append(statistics.mean(gap[a:b]))
            print(f"{p.split('cells/')[-1]} #{it['i']}: {len(ids)} tokens, repeat at {a}: gap prefix "
                  f"{statistics.mean(gap[:a]):+.2f}, repeat {at_repeat[-1]:+.2f}, first token {gap[a]:+.2f}")
    if at_repeat:
        print(f"{len(at_repeat)} looping replies: mean gap on the repeat {statistics.mean(at_repeat):+.3f} nats, "
              f"{sum(g < 0 for g in at_repeat)} of them negative")


if __name__ == "__main__":
    main(sys.argv[1:])
