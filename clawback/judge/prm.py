"""The judge: turns (request, response, next state) into a reward in {-1, 0, 1} and, optionally,
a hindsight hint for the response.

Pure logic plus one await point (`backend.complete`): prompt building from versioned templates,
parsing `\\boxed{...}` votes, majority voting, hint selection. Nothing here knows which model
judges; see `backends.py`.

Unlike the original OpenClaw-RL judge, which saw only the response and the next state, this one
is shown the user's request and a bounded slice of recent context, and never the response's
`<think>` reasoning (which would cost context and invite grading the thinking, not the reply).
`context="response_only"` restores the original's view (used by the `seed` recipe).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from importlib.resources import files
from typing import Any, Literal, TypedDict, Unpack

from clawback.replies import parse_tool_calls

from .backends import JudgeBackend, PromptTooLongError

PRM_PROMPT = "prm_v1"
HINT_PROMPT = "hint_v1"

# What the judge reads is bounded so a judge prompt stays small whatever the conversation size.
CONTEXT_MESSAGES = 4  # recent messages shown besides the request itself
CONTEXT_CHARS = 2000
CONTEXT_MESSAGE_CHARS = 1000  # so one huge tool output cannot crowd out the rest of the context
REQUEST_CHARS = 2000
RESPONSE_CHARS = 3000
NEXT_STATE_CHARS = 2000
MIN_HINT_CHARS = 10  # a positive vote's hint must be longer than this to be used

Message = Mapping[str, Any]

# What the judge sees besides the response and the next state: "full" = the request and recent
# context (ours); "response_only" = nothing else, as the original OpenClaw-RL judge (the `seed`
# preset). The template is the same; the hidden fields read NOT_SHOWN.
JudgeContext = Literal["full", "response_only"]
NOT_SHOWN = "(not shown to the judge)"


# ---------------------------------------------------------------- results


@dataclass(frozen=True)
class Vote:
    score: int | None  # None: the vote failed (timeout, backend error, no valid \boxed{})
    raw: str  # the judge's last reply text ("" if none arrived)
    prompt_version: str
    hint: str | None = None
    error: str | None = None
    attempts: int = 1
    seconds: float = 0.0


@dataclass(frozen=True)
class Verdict:
    score: int | None  # majority of the valid votes; None when every vote failed
    votes: tuple[Vote, ...]
    prompt_version: str
    backend: str
    hint: str | None = None  # hint verdicts: select_hint(votes); a PRM verdict has none

    @property
    def failed_votes(self) -> int:
        return sum(v.score is None for v in self.votes)


# ---------------------------------------------------------------- parsing and voting

_BOXED = re.compile(r"\\boxed\s*\{([^{}]*)\}")
_INTEGER = re.compile(r"[+-]?\d+")
_HINT = re.compile(r"\[HINT_START\](.*?)\[HINT_END\]", re.DOTALL)


def parse_score(text: str, allowed: Iterable[int] = (-1, 0, 1)) -> int | None:
    """The value of the last `\\boxed{...}` in `text`, or None if it is missing or not allowed.

    Only the last box counts, even when it is invalid: a judge that changes its mind to something
    unusable has not given a usable answer.
    """
    boxes = _BOXED.findall(text or "")
    if not boxes:
        return None
    value = boxes[-1].strip()
    if not _INTEGER.fullmatch(value):
        return None
    score = int(value)
    return score if score in tuple(allowed) else None


def parse_hint(text: str) -> tuple[int | None, str | None]:
    """(score in {-1, 1} or None, the text of the last [HINT_START]...[HINT_END] block or None)."""
    hints = _HINT.findall(text or "")
    hint = hints[-1].strip() if hints else None
    return parse_score(text, allowed=(-1, 1)), hint or None


def majority(scores: Iterable[int | None]) -> int | None:
    """Most common valid score; a tie for first place is 0; no valid score at all is None."""
    counts = Counter(s for s in scores if s is not None).most_common()
    if not counts:
        return None
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return 0
    return counts[0][0]


def candidate_hints(votes: Iterable[Vote], limit: int = 3) -> list[str]:
    """The distinct hints (over MIN_HINT_CHARS) of positive votes, in vote order, at most `limit`."""
    out: list[str] = []
    for vote in votes:
        hint = (vote.hint or "").strip()
        if vote.score == 1 and len(hint) > MIN_HINT_CHARS and hint not in out:
            out.append(hint)
    return out[:limit]


def select_hint(votes: Iterable[Vote]) -> str | None:
    """The longest hint (over MIN_HINT_CHARS) among positive votes; the first such on a length tie."""
    best: str | None = None
    for vote in votes:
        hint = (vote.hint or "").strip()
        if vote.score == 1 and len(hint) > MIN_HINT_CHARS and (best is None or len(hint) > len(best)):
            best = hint
    return best


# ---------------------------------------------------------------- what the judge reads

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_reasoning(text: str) -> str:
    """Remove `<think>` reasoning from a reply.

    Also handles the two broken shapes seen in practice: a reply that starts inside its reasoning
    (thinking templates put `<think>` in the prompt, so the reply holds only `</think>`), and one
    cut off before its reasoning ended (nothing after `<think>` is an answer).
    """
    text = _THINK_BLOCK.sub("", text or "")
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        text = text.split("<think>", 1)[0]
    return text.strip()


def clip(text: str, limit: int) -> str:
    """`text` cut to about `limit` characters, keeping its start and its end."""
    if len(text) <= limit:
        return text
    cut = len(text) - limit
    head = limit * 3 // 5
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[len(text) - (limit - head):]}"


def message_text(message: Message) -> str:
    """The text of a message whose content is a string or a list of content parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif part.get("type") == "refusal":
            parts.append(part.get("refusal") or "")
        elif part.get("text") is not None:
            parts.append(part["text"])
        else:
            parts.append(f"[{part.get('type', 'non-text')} content]")
    return "\n".join(parts)


def _call_text(name: str, arguments: object) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return f"[calls tool {name} with {arguments}]"
    return f"[calls tool {name} with {json.dumps(arguments, ensure_ascii=False)}]"


def _as_dict(message: Any) -> Message:  # Any: a stored message dict or a daemon `chat.Message`
    if hasattr(message, "model_dump"):  # a daemon `chat.Message` rather than a stored dict
        return message.model_dump(exclude_none=True)
    return message


def render_message(message: Message) -> str:
    """One message as a labelled, readable block (tool calls as `[calls tool NAME with ARGS]`)."""
    message = _as_dict(message)
    role = message.get("role", "?")
    text = message_text(message)
    if role == "assistant":
        text = strip_reasoning(text)
        calls = [
            _call_text(c["function"]["name"], c["function"].get("arguments", "{}"))
            for c in message.get("tool_calls") or []
        ]
        text = "\n".join([t for t in [text, *calls] if t])
    label = role
    if role == "tool":
        source = message.get("name") or message.get("tool_call_id")
        label = f"tool result from {source}" if source else "tool result"
    return f"[{label}]\n{text}"


def response_for_judge(response_text: str) -> str:
    """The reply without reasoning, its Hermes `<tool_call>` blocks written as readable calls."""
    text = strip_reasoning(response_text)
    content, calls = parse_tool_calls(text)
    rendered = [_call_text(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    return clip("\n".join([t for t in [content or "", *rendered] if t]) or "(empty reply)", RESPONSE_CHARS)


def _context_fields(request_messages: Sequence[Message]) -> dict[str, str]:
    """The request (last user message) and a bounded slice of the messages around it.

    System prompts are left out: agent system prompts run to tens of kilobytes and say nothing
    about whether this reply worked. The slice is filled newest first, so in a tool loop the
    steps since the request win over older conversation.
    """
    messages = [_as_dict(m) for m in request_messages]
    visible = [m for m in messages if m.get("role") not in ("system", "developer")]
    last_user = max((i for i, m in enumerate(visible) if m.get("role") == "user"), default=None)
    request = clip(message_text(visible[last_user]), REQUEST_CHARS) if last_user is not None else "(no user message)"
    earlier: list[str] = []
    since: list[str] = []
    budget, shown = CONTEXT_CHARS, 0
    for i in range(len(visible) - 1, -1, -1):
        if i == last_user:
            continue
        if shown == CONTEXT_MESSAGES or budget < 100:
            break
        block = clip(render_message(visible[i]), min(budget, CONTEXT_MESSAGE_CHARS))
        budget -= len(block)
        shown += 1
        (since if last_user is not None and i > last_user else earlier).insert(0, block)
    return {
        "earlier": "\n\n".join(earlier) or "(none)",
        "request": request,
        "since_request": "\n\n".join(since) or "(nothing yet)",
    }


def _next_state_fields(next_state: Sequence[Message] | str) -> dict[str, str]:
    """A plain string is the user's explicit feedback (e.g. from /v1/feedback)."""
    if isinstance(next_state, str):
        next_state = [{"role": "user", "content": next_state}]
    next_state = [_as_dict(m) for m in next_state]
    roles = list(dict.fromkeys(m.get("role", "?") for m in next_state))
    text = "\n\n".join(render_message(m) for m in next_state)
    return {"next_role": ", ".join(roles) or "none", "next_state": clip(text, NEXT_STATE_CHARS) or "(empty)"}


# ---------------------------------------------------------------- templates


@dataclass(frozen=True)
class PromptTemplate:
    version: str  # the file stem, stored with every vote
    system: str
    user: str

    def render(self, fields: Mapping[str, str]) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": fill(self.system, fields)},
            {"role": "user", "content": fill(self.user, fields)},
        ]


_PLACEHOLDER = re.compile(r"\{([a-z_]+)\}")


def fill(template: str, fields: Mapping[str, str]) -> str:
    """Replace `{name}` placeholders in one pass.

    Unlike str.format, substituted text is never scanned again and other braces in the template
    (`\\boxed{1}`) are left alone, so user content holding `{x}` or `}` is inserted verbatim.
    """

    def sub(match: re.Match) -> str:
        if match.group(1) not in fields:
            raise KeyError(f"template placeholder {{{match.group(1)}}} has no value")
        return fields[match.group(1)]

    return _PLACEHOLDER.sub(sub, template)


@cache
def load_template(version: str) -> PromptTemplate:
    """Read `prompts/<version>.txt`: a `[[system]]` section, then a `[[user]]` section.

    Templates list the neutral option last (`\\boxed{1}, \\boxed{-1} or \\boxed{0}`): a small
    judge that only echoes the instructions then parses as 0, no reward, instead of a -1.
    """
    text = (files("clawback.judge") / "prompts" / f"{version}.txt").read_text(encoding="utf-8")
    match = re.fullmatch(r"\s*\[\[system\]\]\n(.*)\n\[\[user\]\]\n(.*)", text, re.DOTALL)
    if not match:
        raise ValueError(f"prompt template {version!r} needs a [[system]] and then a [[user]] section")
    return PromptTemplate(version, match.group(1).strip(), match.group(2).strip())


def _judge_fields(request_messages: Sequence[Message], response_text: str, next_state: Sequence[Message] | str,
                  context: JudgeContext = "full") -> dict[str, str]:
    if context not in ("full", "response_only"):
        raise ValueError(f"unknown judge context {context!r}; choose full or response_only")
    shown: dict[str, str] = _context_fields(request_messages) if context == "full" else dict.fromkeys(
        ("earlier", "request", "since_request"), NOT_SHOWN)
    return {
        **shown,
        "response": response_for_judge(response_text),
        **_next_state_fields(next_state),
    }


def build_messages(
    request_messages: Sequence[Message], response_text: str, next_state: Sequence[Message] | str,
    prompt_version: str = PRM_PROMPT, context: JudgeContext = "full",
) -> list[dict[str, str]]:
    """The judge's chat messages: the versioned template (PRM or hint) filled with the conversation."""
    return load_template(prompt_version).render(_judge_fields(request_messages, response_text, next_state, context))


# ---------------------------------------------------------------- running votes


async def _vote(
    backend: JudgeBackend, messages: list[dict[str, str]], parse: Callable[[str], tuple[int | None, str | None]],
    prompt_version: str, *, temperature: float, max_tokens: int, timeout_s: float, retries: int,
    seeds: list[int | None],
) -> Vote:
    """One vote: up to 1 + retries attempts, each under its own timeout."""
    started = time.monotonic()
    raw, error = "", None
    for attempt in range(retries + 1):
        try:
            raw = await asyncio.wait_for(
                backend.complete(messages, temperature=temperature, max_tokens=max_tokens, seed=seeds[attempt]),
                timeout_s,
            )
        except TimeoutError:
            error = f"timed out after {timeout_s:g}s"
            continue
        except PromptTooLongError as e:  # the same prompt will not fit on a retry either
            return Vote(None, "", prompt_version, error=str(e), attempts=attempt + 1, seconds=time.monotonic() - started)
        except Exception as e:  # a failed vote, never a failed verdict
            error = f"{type(e).__name__}: {e}"
            continue
        score, hint = parse(raw)
        if score is not None:
            return Vote(score, raw, prompt_version, hint=hint, attempts=attempt + 1, seconds=time.monotonic() - started)
        error = "no valid \\boxed{} score in the reply"
    return Vote(None, raw, prompt_version, error=error, attempts=retries + 1, seconds=time.monotonic() - started)


class VoteOptions(TypedDict, total=False):
    """How a verdict's votes are taken; each is optional (defaults in `_run_votes`)."""

    m: int  # concurrent votes, odd so that 1 and -1 cannot tie
    temperature: float
    max_tokens: int
    timeout_s: float  # per attempt
    retries: int  # further attempts of a vote that failed
    seed: int | None  # votes and attempts get distinct seeds derived from it
    context: JudgeContext  # what the judge sees of the conversation


async def _run_votes(
    backend: JudgeBackend, request_messages: Sequence[Message], response_text: str,
    next_state: Sequence[Message] | str, prompt_version: str, parse: Callable[[str], tuple[int | None, str | None]],
    options: VoteOptions,
) -> tuple[Vote, ...]:
    m, retries, seed = options.get("m", 3), options.get("retries", 1), options.get("seed")
    temperature, max_tokens = options.get("temperature", 0.6), options.get("max_tokens", 1024)
    timeout_s = options.get("timeout_s", 120.0)
    if m < 1 or m % 2 == 0:
        raise ValueError(f"m must be odd (got {m}) so a vote between 1 and -1 cannot tie")
    if retries < 0:
        raise ValueError("retries must be >= 0")
    messages = build_messages(request_messages, response_text, next_state, prompt_version,
                              options.get("context", "full"))

    def seeds(i: int) -> list[int | None]:  # distinct per vote and attempt, reproducible from one seed
        return [None if seed is None else seed + i + a * m for a in range(retries + 1)]

    return tuple(await asyncio.gather(*(
        _vote(backend, messages, parse, prompt_version, temperature=temperature, max_tokens=max_tokens,
              timeout_s=timeout_s, retries=retries, seeds=seeds(i))
        for i in range(m)
    )))


async def judge_prm(
    backend: JudgeBackend, request_messages: Sequence[Message], response_text: str,
    next_state: Sequence[Message] | str, *, prompt_version: str = PRM_PROMPT, **options: Unpack[VoteOptions],
) -> Verdict:
    """Score the response from its next state with m concurrent votes (m odd)."""
    votes = await _run_votes(backend, request_messages, response_text, next_state, prompt_version,
                             lambda raw: (parse_score(raw), None), options)
    return Verdict(majority(v.score for v in votes), votes, prompt_version, backend.name)


async def judge_hint(
    backend: JudgeBackend, request_messages: Sequence[Message], response_text: str,
    next_state: Sequence[Message] | str, *, prompt_version: str = HINT_PROMPT, **options: Unpack[VoteOptions],
) -> Verdict:
    """Ask m concurrent votes whether the next state says how the response should have been; the
    verdict's score is 1 when it does, and its hint the chosen one (select_hint)."""
    votes = await _run_votes(backend, request_messages, response_text, next_state, prompt_version, parse_hint,
                             options)
    return Verdict(majority(v.score for v in votes), votes, prompt_version, backend.name, select_hint(votes))
