"""The capability-retention probe set and the collapse statistics of a set of generations.

`gate_probes.jsonl` (package data) holds short prompts whose answers a rule can check: arithmetic
(the number appears), facts (an accepted word appears), format instructions (the reply's shape:
a regex, JSON, lines) and tool calls (a call of the named tool whose arguments fit its schema).
The gate generates greedily from each and scores the share that passes, in points of 100.

`collapse_stats` summarises any set of generations (probe replies, replies to held-out prompts)
with the numbers the collapse detectors compare between a candidate and the live version;
`collapse_reasons` and `against_live_and_base` are those detectors (docs/gate.md).
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from itertools import combinations

from clawback.records import JsonObject
from clawback.replies import parse_tool_calls, repeats_a_sentence

from .config import GateConfig


@dataclass(frozen=True)
class Probe:
    id: str
    kind: str  # arithmetic | fact | format | tool_call
    prompt: str
    check: JsonObject  # the rule `passes` applies, as gate_probes.jsonl gives it
    tools: tuple[JsonObject, ...] = ()  # OpenAI tool schemas


@dataclass(frozen=True)
class Generation:
    """One greedy reply: its token ids (end token excluded), their logprobs, text, and whether it
    ended by itself (`stop`) or ran into the token limit (`length`)."""

    ids: list[int]
    logprobs: list[float]
    text: str
    finish: str


def load_probes() -> list[Probe]:
    text = resources.files("clawback.daemon").joinpath("gate_probes.jsonl").read_text()
    return [Probe(**{**p, "tools": tuple(p.get("tools", ()))}) for p in map(json.loads, text.splitlines()) if p]


def passes(probe: Probe, text: str) -> bool:
    """Whether a reply satisfies its probe's rule."""
    check, reply = probe.check, text.strip()
    if "number" in check:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", reply.replace(",", ""))
        return any(float(n) == float(check["number"]) for n in numbers)
    if "any_word" in check:
        return any(re.search(rf"(?<!\w){re.escape(w)}(?!\w)", reply, re.I) for w in check["any_word"])
    if "regex" in check:
        flags = (re.I if "i" in check.get("flags", "") else 0) | (re.S if "s" in check.get("flags", "") else 0)
        return re.search(check["regex"], reply, flags) is not None
    if "min_lines_matching" in check:
        pattern, n = check["min_lines_matching"]
        return sum(re.search(pattern, line) is not None for line in reply.splitlines()) >= n
    if "json_has" in check:
        value = _first_json(reply)
        return isinstance(value, dict) and all(value.get(k) == v for k, v in check["json_has"].items())
    if "json_equals" in check:
        return _first_json(reply) == check["json_equals"]
    if "tool" in check:
        return check["tool"] in working_calls(text, probe.tools)
    raise ValueError(f"probe {probe.id}: unknown check {sorted(check)}")


def working_calls(text: str, tools: Sequence[JsonObject]) -> set[str]:
    """The names of the offered `tools` that a reply calls, as serving reads its calls, with
    arguments that fit the tool's schema: the calls an agent could run."""
    schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    _, calls = parse_tool_calls(text, list(schemas))
    return {c["function"]["name"] for c in calls
            if c["function"]["name"] in schemas and _fits(_json_or_none(c["function"]["arguments"]), schemas[c["function"]["name"]])}


def _first_json(text: str) -> object:
    decoder = json.JSONDecoder()
    for i, ch in enumerate(text):
        if ch in "{[":
            try:
                return decoder.raw_decode(text, i)[0]
            except json.JSONDecodeError:
                continue
    return None


def _json_or_none(text: str) -> object:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return None


_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def _fits(args: object, schema: JsonObject) -> bool:
    """The part of JSON Schema tool definitions use: an object, required keys, property types."""
    if not isinstance(args, dict):
        return False
    if any(k not in args for k in schema.get("required", ())):
        return False
    for key, prop in (schema.get("properties") or {}).items():
        want = _TYPES.get(prop.get("type", ""))
        if key in args and want is not None:
            value = args[key]
            if isinstance(value, bool) and prop["type"] != "boolean":
                return False
            if not isinstance(value, want):
                return False
    return True


# Replies about the conversation itself instead of the task: apologies, thanks for feedback,
# commentary on the person's mood. A policy rewarded on reactions drifts into these.
META_REPLY = re.compile(
    r"\b(sorry for (the|any) (confusion|misunderstanding|mistake)|i apologi[sz]e|my apologies|"
    r"(glad|happy) (that )?you('re| are)? (happy|satisfied|pleased)|i'?m glad (to hear|you)|"
    r"thank you for (your|the) (feedback|correction|patience)|thanks for (the|your) (feedback|correction)|"
    r"i understand your (frustration|concern)|you'?re (absolutely )?right)\b", re.I)


# Replies that decline the task: "as a chatbot, I don't have the capability to…", "I'm unable to
# assist with…". A small policy trained on corrections can drift into declining everything (the
# simulator's "apology mode"); a person never wants more of it, whatever they asked for.
REFUSAL_REPLY = re.compile(
    r"\b(as an? (ai|chatbot|language model|virtual assistant)\b[^.]{0,100}?\b(can(no|')?t|not|unable|don'?t)|"
    r"i('?m| am) (not able|unable|not equipped|not designed|not capable) to|"
    r"i (can(no|')?t|do not|don'?t) (help|assist|provide|access|have the (capability|ability|capacity)))", re.I)


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def ends_in_loop(ids: list[int], min_loop_tokens: int = 32, max_period: int = 32) -> bool:
    """Whether a reply ends in one short token sequence repeated over at least half of it."""
    n = len(ids)
    if n < min_loop_tokens:
        return False
    for period in range(1, max_period + 1):
        tail = period  # length of the suffix that repeats with this period
        while tail < n and ids[n - 1 - tail] == ids[n - 1 - tail + period]:
            tail += 1
        if tail >= max(n // 2, 4 * period, min_loop_tokens // 2):
            return True
    return False


@dataclass(frozen=True)
class CollapseStats:
    """What the collapse detectors compare (docs/gate.md), of one set of replies."""

    # Mean −logprob of the greedy tokens (the min-entropy of each step's distribution, a lower
    # bound of its Shannon entropy), nats.
    min_entropy: float
    distinct_2: float  # mean share of distinct word bigrams within a reply (repetition inside a reply)
    # Mean Jaccard similarity of word-trigram sets between replies to different prompts (the same
    # reply whatever was asked).
    self_similarity: float
    median_tokens: float  # median reply length in tokens
    empty_rate: float  # share of replies with no text
    cut_rate: float  # share of replies that hit the token limit
    loop_rate: float  # share of replies that end in a repetition loop (`ends_in_loop`)
    # Share of replies that say one sentence twice, word for word (`replies.repeats_a_sentence`):
    # a stutter ("Great question! Great question!") long before a loop fills the reply.
    repeat_rate: float
    meta_rate: float  # share of replies about the conversation itself (META_REPLY)
    refusal_rate: float  # share of replies that decline the task (REFUSAL_REPLY)
    # Of the replies to requests that offered tools, the share that make no call an agent could run
    # (`working_calls`: none at all, an invented tool, arguments that do not fit); 0 when no request
    # offered tools.
    no_working_call_rate: float = 0.0


def collapse_stats(gens: list[Generation], tools: Sequence[Sequence[JsonObject]] = ()) -> CollapseStats:
    """The collapse statistics of a set of generations; `tools`, when given, the tools each one's
    request offered."""
    n = max(len(gens), 1)
    offered = [(g, t) for g, t in zip(gens, tools) if t]
    logprobs = [lp for g in gens for lp in g.logprobs]
    words = [_words(g.text) for g in gens]
    distinct = [len(set(b)) / len(b) for b in (_ngrams(w, 2) for w in words) if len(b) >= 2]
    trigrams = [set(_ngrams(w, 3)) for w in words if len(w) >= 3]
    sims = [len(a & b) / len(a | b) for a, b in combinations(trigrams, 2)]
    return CollapseStats(
        min_entropy=-sum(logprobs) / len(logprobs) if logprobs else 0.0,
        distinct_2=sum(distinct) / len(distinct) if distinct else 1.0,
        self_similarity=sum(sims) / len(sims) if sims else 0.0,
        median_tokens=float(statistics.median([len(g.ids) for g in gens])) if gens else 0.0,
        empty_rate=sum(not g.text.strip() for g in gens) / n,
        cut_rate=sum(g.finish == "length" for g in gens) / n,
        loop_rate=sum(ends_in_loop(g.ids) for g in gens) / n,
        repeat_rate=sum(repeats_a_sentence(g.text) for g in gens) / n,
        meta_rate=sum(META_REPLY.search(g.text) is not None for g in gens) / n,
        refusal_rate=sum(REFUSAL_REPLY.search(g.text) is not None for g in gens) / n,
        no_working_call_rate=sum(not working_calls(g.text, t) for g, t in offered) / max(len(offered), 1),
    )


# What a person never wants more of, whatever they asked for: also held to the base model, so
# that small rises that each pass against the live version cannot add up over versions.
NEVER_WANTED = ("distinct_2", "self_similarity", "empty_rate", "repeat_rate", "meta_rate", "refusal_rate",
                "no_working_call_rate")
# What the person's own requests are not held to: what they ask for often changes how long their
# replies are ("answer in under 20 words"); runaway and empty replies are still caught there by
# the cut-off and empty detectors.
NOT_ON_OWN_REQUESTS = ("median_tokens",)


def collapse_reasons(cand: CollapseStats, live: CollapseStats, cfg: GateConfig, live_name: str,
                     on: str | None = None, only: tuple[str, ...] | None = None,
                     skip: tuple[str, ...] = ()) -> list[str]:
    """Collapse alarms: each detector (or those in `only`, less those in `skip`) against the
    reference version's value (docs/gate.md); `on` names replies other than the probes'."""
    out = []

    def check(key: str) -> bool:
        return (only is None or key in only) and key not in skip

    if check("min_entropy") and cand.min_entropy < cfg.entropy_low * live.min_entropy:
        out.append(f"collapse: token entropy {cand.min_entropy:.2f} vs {live.min_entropy:.2f} nats on {live_name}")
    if check("min_entropy") and cand.min_entropy > cfg.entropy_high * live.min_entropy + 0.5:
        out.append(f"collapse: token entropy blew up, {cand.min_entropy:.2f} vs {live.min_entropy:.2f} nats on {live_name}")
    if check("distinct_2") and cand.distinct_2 < live.distinct_2 - cfg.distinct_drop:
        out.append(f"collapse: repetition, distinct-2 {cand.distinct_2:.2f} vs {live.distinct_2:.2f} on {live_name}")
    if check("self_similarity") and cand.self_similarity > live.self_similarity + cfg.similarity_rise:
        out.append(f"collapse: same reply to different prompts, similarity {cand.self_similarity:.2f} "
                   f"vs {live.self_similarity:.2f} on {live_name}")
    a, b = cand.median_tokens, live.median_tokens
    if check("median_tokens") and abs(a - b) >= cfg.length_min_change and (a > cfg.length_ratio * b or a * cfg.length_ratio < b):
        out.append(f"collapse: reply length {a:.0f} vs {b:.0f} tokens on {live_name}")
    for key, limit, what in (("empty_rate", cfg.empty_rise, "empty replies"), ("cut_rate", cfg.cut_rise, "cut-off replies"),
                             ("loop_rate", cfg.loop_rise, "looping replies"),
                             ("repeat_rate", cfg.repeat_rise, "replies that repeat a sentence"),
                             ("meta_rate", cfg.meta_rise, "replies about the conversation"),
                             ("refusal_rate", cfg.refusal_rise, "replies that decline the task"),
                             ("no_working_call_rate", cfg.tool_call_drop, "replies with no tool call that could run")):
        # A rise by the limit or more: a share moves in steps of 1/n, and 0.75 - 0.5 must count as 0.25.
        ours, theirs = getattr(cand, key), getattr(live, key)
        if check(key) and ours - theirs >= limit - 1e-9:
            out.append(f"collapse: {what} {ours:.0%} vs {theirs:.0%} on {live_name}")
    return [r.replace("collapse:", f"collapse ({on}):", 1) for r in out] if on else out


def against_live_and_base(cand: CollapseStats, live: CollapseStats, base: CollapseStats | None,
                          cfg: GateConfig, live_name: str | None, on: str | None = None,
                          skip: tuple[str, ...] = ()) -> list[str]:
    """Every detector (less `skip`) against live; the NEVER_WANTED ones against the base model
    too (base None: live is the base model)."""
    reasons = collapse_reasons(cand, live, cfg, live_name or "base", on, skip=skip)
    if base is not None and live_name is not None:
        reasons += collapse_reasons(cand, base, cfg, "base", on, NEVER_WANTED)
    return reasons
