"""Would a decoding guard against repeats fix the notes' loops?

With the scenario's preference note, SmolLM2-135M's greedy replies on `sure` loop ("Sure! I'd be
happy to help.\\n\\nSure! I'd be happy to help.…"). This generates the greedy replies to the
held-out tasks with the note (as `daemon.memory.inject` puts it), under each decoding guard, and
counts the replies that meet the preference and the broken ones (sim/scenarios.py's gates):

* `plain`: no guard;
* `rpX`: transformers' repetition penalty X (it also penalises the prompt's tokens, the note's
  "Sure" among them; vLLM's and SGLang's `repetition_penalty` do the same);
* `ngN`: no N-gram of the reply said twice (the reply only, not the prompt).

    .venv/bin/python bench/loop_guard.py [--guards plain,rp1.2,ng4] [--only sure,brief] [--tasks 16]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from clawback.chat import ChatRenderer, ChatRequest
from clawback.daemon import memory
from clawback.daemon.config import Settings
from clawback.daemon.models import resolve_model
from clawback.sim.scenarios import BRIEF, SURE, Rating


class NoRepeatInReply(LogitsProcessor):
    """Bans a token that would complete an n-gram the reply (not the prompt) already holds."""

    def __init__(self, n: int, prompt_len: int) -> None:
        self.n, self.start = n, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        said, n = input_ids[0, self.start:].tolist(), self.n
        if len(said) >= n - 1:
            tail = tuple(said[len(said) - n + 1:])
            banned = {said[i + n - 1] for i in range(len(said) - n + 1) if tuple(said[i:i + n - 1]) == tail}
            if banned:
                scores[0, sorted(banned)] = -float("inf")
        return scores


def guard(name: str, prompt_len: int) -> dict:
    if name == "plain":
        return {}
    if name.startswith("rp"):
        return {"repetition_penalty": float(name[2:])}
    if name.startswith("ng"):
        return {"logits_processor": LogitsProcessorList([NoRepeatInReply(int(name[2:]), prompt_len)])}
    raise SystemExit(f"unknown guard {name!r}: plain, rpX or ngN")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--guards", default="plain,rp1.2,ng4")
    p.add_argument("--only", default="sure")
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=400)
    args = p.parse_args()
    torch.set_num_threads(1)
    model_dir = resolve_model(args.model, Settings().models_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    renderer = ChatRenderer(tok)
    print("| scenario | guard | meets the preference | broken |\n|---|---|---|---|")
    for scen in (s for s in (SURE, BRIEF) if s.name in args.only.split(",")):
        pref, = memory.notes_from(scen.correction(Rating(0.0, scen.checks)))[0]
        for name in args.guards.split(","):
            meets = broken = 0
            for task in scen.eval[: args.tasks]:
                messages = memory.inject([{"role": "user", "content": task.prompt}], [pref])
                _, ids = renderer.render(ChatRequest.model_validate({"model": "m", "messages": messages}))
                with torch.no_grad():
                    out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=args.max_tokens,
                                         pad_token_id=tok.eos_token_id, **guard(name, len(ids)))
                new = out[0, len(ids):].tolist()
                rating = scen.rate(tok.decode(new, skip_special_tokens=True), task,
                                   complete=bool(new) and new[-1] == tok.eos_token_id)
                meets += rating.meets
                broken += rating.gate is not None
            print(f"| {scen.name} | {name} | {meets}/{args.tasks} | {broken}/{args.tasks} |", flush=True)


if __name__ == "__main__":
    main()
