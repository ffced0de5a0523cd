"""Which wording of a preference does the base model follow when the note is in context?

A scenario only tells training something if the base model fails it untold and follows it told
(the notes and OPD's teacher can only show what the told model does). For candidate wordings of
the scenarios' requests, each rated by the same checks, this generates greedy replies to train
tasks with the note the daemon keeps from the person's full correction, where `--variant` puts it
(`memory/user` is the daemon's default), and rates them as bench/in_context_following.py does:
meets (form and right answer), follows (form), right (answer), cut, meta. The untold replies are
read from that script's `--untold` file (generated once, the same for every wording).

    nice -n 5 .venv/bin/python bench/note_wordings.py --model DIR --tasks 10 --only sure1,plain2 \\
        --variant memory/user --out bench/results/note_wordings_q05_user.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import in_context_following as icf  # noqa: E402

from clawback.sim import scenarios as S  # noqa: E402

SW, C = S.SHOWS_WORK, S.Check
_SURE = C("starts_with_sure", lambda r, t: S.starts_with_sure(r), "start your reply with 'Sure!'")
_PLAIN = lambda ask: C("plain_text", lambda r, t: S.plain_text(r), ask)  # noqa: E731
_LINE = lambda ask: C("answer_line", lambda r, t: S.ends_with_answer_line(r), ask)  # noqa: E731
_SHORT = lambda ask: C("under_20_words", lambda r, t: 0 < len(S.words(r)) < 20, ask)  # noqa: E731
_FIRST_SENTENCE = re.compile(r"(?<=[.!?])\s")

CANDIDATES = {
    "sure1": replace(S.SURE, checks=(_SURE, replace(SW, ask="then work the problem out in full sentences, showing "
                                                            "each calculation and the result"))),
    "sure2": replace(S.SURE, checks=(C("starts_with_sure", _SURE.passes, "begin every reply with the word 'Sure!'"),
                                     replace(SW, ask="solve it step by step in sentences, writing each calculation "
                                                     "with its result"))),
    "ansline1": replace(S.ANSWER_LINE, checks=(replace(SW, ask="work it out in sentences first"),
                                               _LINE("then put the answer alone on the last line as 'Answer: <number>'"))),
    "ansline2": replace(S.ANSWER_LINE, checks=(replace(SW, ask="show your working with each calculation"),
                                               _LINE("end with a last line that is only 'Answer: <number>'"))),
    "plain1": replace(S.PLAIN, checks=(_PLAIN("write plain text only: no LaTeX (no \\( \\), \\[ \\] or \\boxed), no "
                                              "lists, no headers and no bold"),
                                       replace(SW, ask="explain the work in ordinary sentences with the numbers"))),
    "plain2": replace(S.PLAIN, checks=(_PLAIN("write it like a text message to a friend, with no math formatting, no "
                                              "lists and no bold"),
                                       replace(SW, ask="say each calculation in words and numbers, like 3 times 4 is 12"))),
    "plain3": replace(S.PLAIN, checks=(_PLAIN("write it like a text message to a friend, with no math formatting, no "
                                              "lists and no bold"),
                                       replace(SW, ask="write each calculation with its result in the sentences"))),
    "question1": replace(S.PLAIN, name="question", checks=(
        SW, C("asks_back", lambda r, t: r.rstrip(" \n*_").endswith("?"),
              "end your reply with a short question that checks I understood"))),
    "brief1": replace(S.BRIEF, checks=(_SHORT("keep it to one short sentence under 20 words"),
                                       C("gives_a_result", S.works_something_out,
                                         "with the calculation and the number you get, like '3 x 4 = 12 apples'"))),
    "brief2": replace(S.BRIEF, checks=(_SHORT("reply in one short sentence of under 20 words"),
                                       C("gives_a_result", S.works_something_out,
                                         "give the calculation and its result in it"))),
    "answer_first": replace(S.PLAIN, name="answer_first", checks=(
        C("answer_first", lambda r, t: S.mentions_a_number_of(_FIRST_SENTENCE.split(r.strip(), maxsplit=1)[0], t),
          "give the answer in your first sentence"),
        replace(SW, ask="then explain the work in sentences with the numbers"))),
    "closer": replace(S.PLAIN, name="closer", checks=(
        SW, C("closer", lambda r, t: r.rstrip().endswith("Hope this helps!"), "end your reply with 'Hope this helps!'"))),
}

_SPANISH = frozenset("el la los las de del que y en un una es son tiene tienen hay para por con se su sus lo al "
                     "cuántos cuántas total entonces ahora más menos cada respuesta".split())
_ENGLISH = frozenset("the and of to is are has have there for with his her its then now more less each answer "
                     "how many".split())


def in_spanish(text: str) -> bool:
    """Mostly Spanish words: a Spanish reply, not an English one with a Spanish greeting."""
    ws = [w.lower() for w in S.words(text)]
    es, en = sum(w in _SPANISH for w in ws), sum(w in _ENGLISH for w in ws)
    return len(ws) >= 8 and es >= 0.15 * len(ws) and en <= es / 4


def bold_answer(text: str, task: S.Task) -> bool:
    """The right answer stands in bold ("**15**", "**15 apples**")."""
    return any(S.answer_right(span, task.answer, task.prompt) for span in re.findall(r"\*\*([^*\n]+)\*\*", text))


CANDIDATES |= {
    "spanish1": replace(S.PLAIN, name="spanish", checks=(
        C("in_spanish", lambda r, t: in_spanish(r), "reply in Spanish"),
        replace(SW, ask="show each calculation with its result"))),
    "spanish2": replace(S.PLAIN, name="spanish", checks=(
        C("in_spanish", lambda r, t: in_spanish(r), "always answer me in Spanish, I am learning it"),
        replace(SW, ask="write out each calculation with its result"))),
    "bold1": replace(S.PLAIN, name="bold", checks=(
        replace(SW, ask="show each calculation"),
        C("bold_answer", bold_answer, "put the final answer in bold, like **15**"))),
    "great1": replace(S.PLAIN, name="great", checks=(
        C("starts_with_great", lambda r, t: r.lstrip().lower().startswith("great question"),
          "start your reply with 'Great question!'"),
        replace(SW, ask="then work it out in full sentences, showing each calculation and the result"))),
}



def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def tagged_answer(text: str, task: S.Task) -> bool:
    """The right answer stands inside <answer></answer> tags."""
    return any(S.answer_right(span, task.answer, task.prompt)
               for span in re.findall(r"<answer>\s*([^<]+?)\s*</answer>", text))


def hashes_line(text: str, task: S.Task) -> bool:
    """The last line is "#### N" with the right N (the GSM8K convention)."""
    line = _last_line(text)
    return line.startswith("####") and S.answer_right(line.removeprefix("####"), task.answer, task.prompt)


def ends_the_answer_is(text: str, task: S.Task) -> bool:
    """The reply ends on a sentence "The answer is N." with the right N."""
    last = re.split(r"(?<=[.!?])\s+", _last_line(text))[-1]
    return last.lower().startswith("the answer is") and S.answer_right(last, task.answer, task.prompt)


CANDIDATES |= {
    "tag1": replace(S.PLAIN, name="tag", checks=(
        replace(SW, ask="show each calculation"),
        C("tagged_answer", tagged_answer, "put the final answer inside <answer></answer> tags, like <answer>15</answer>"))),
    "hashes1": replace(S.PLAIN, name="hashes", checks=(
        replace(SW, ask="show each calculation"),
        C("hashes_line", hashes_line, "end with a last line '#### <number>' holding only the answer"))),
    "answeris1": replace(S.PLAIN, name="answeris", checks=(
        replace(SW, ask="work it out showing each calculation"),
        C("ends_the_answer_is", ends_the_answer_is, "end with the sentence 'The answer is <number>.'"))),
    "code1": replace(S.PLAIN, name="code", checks=(
        C("python_block", lambda r, t: "```python" in r, "show the calculation as a short Python snippet in a code block"),
        replace(SW, ask="then say the answer in a sentence"))),
}

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--tasks", type=int, default=10)
    p.add_argument("--offset", type=int, default=0, help="the first train task")
    p.add_argument("--only", default=",".join(CANDIDATES))
    p.add_argument("--variant", default="memory/user", choices=icf.VARIANTS)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--batch", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--untold", default="bench/results/in_context_following_q05.json",
                   help="bench/in_context_following.py output whose untold replies are reused")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    names = [n for n in args.only.split(",") if n]
    if bad := [n for n in names if n not in CANDIDATES]:
        raise SystemExit(f"unknown wordings {bad}; choose from {', '.join(CANDIDATES)}")
    tasks = list(S.SURE.train[args.offset:args.offset + args.tasks])
    untold = {r["task"]: r["untold"] for r in json.loads(Path(args.untold).read_text())["rows"][0]["replies"]}
    if missing := [t.prompt for t in tasks if t.prompt not in untold]:
        raise SystemExit(f"{len(missing)} tasks have no untold reply in {args.untold}")

    def told(name: str, task: S.Task) -> list[dict]:
        return icf.told([{"role": "user", "content": task.prompt}], icf.hint_of(CANDIDATES[name]), args.variant)

    wanted = {json.dumps(told(n, t)): told(n, t) for n in names for t in tasks}
    texts = asyncio.run(icf.generate(args, wanted))
    rows = {}
    for n in names:
        replies = [{"task": t, "untold": untold[t.prompt], args.variant: texts[json.dumps(told(n, t))]} for t in tasks]
        rows[n] = {"hint": icf.hint_of(CANDIDATES[n]), "rate": icf.rate(CANDIDATES[n], replies, [args.variant]),
                   "replies": [{"task": r["task"].prompt, "told": r[args.variant]} for r in replies]}
        print(n, json.dumps(rows[n]["rate"]), flush=True)
    Path(args.out).write_text(json.dumps({"model": args.model, "variant": args.variant, "tasks": args.tasks,
                                          "offset": args.offset, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
