"""Outcome rules: a tool result that states how it went rewards the call that asked for it.

A main call that made tool calls gets the tool results as its next state (capture.py). When one
of those results states its outcome (a test runner's closing summary, an error object, a stack
trace, a command's exit code), that is a reward without a judge: `success_reward` or
`failure_reward` from `[signals.outcomes]`, and for a failure the failing part of the output is
the hindsight hint that the OPD teacher sees (samples.py). The rules, in the order they are tried
on each tool result (the first that recognises it decides):

- `test_summary`: the closing lines of pytest, unittest, jest, vitest, `node --test`, `go test`
  and `cargo test`. Any failed or erroring test is a failure; passed tests and none failed a
  success; a run without tests says nothing.
- `error_object`: a JSON object with `"status": "error"` (or `"failed"`) or a non-empty `error`,
  as OpenClaw's tool wrapper returns when a tool throws.
- `traceback`: a Python traceback or a JavaScript error with its stack (`    at ...` lines).
- `exit_code`: OpenClaw's exec tool, which ends a non-zero exit with `(Command exited with code N)`
  and a failed start with `Command not found`, `Command timed out ...`, `Command aborted by
  signal ...`; or a JSON object with `exitCode`, `exit_code` or `returncode` (0 is a success).
  OpenClaw says nothing on a zero exit, so its exec results are only ever failures here.
- `unknown_tool`: OpenClaw's answer to a call of a tool it does not have (`Tool NAME not found`).

Of several tool results the call fails if any fails, else succeeds if any succeeds. A result no
rule recognises says nothing, and the sample is judged (or not) as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from clawback.records import JsonObject, Outcome

EVIDENCE_CHARS = 600  # the hint: the end of the output up to the line that told, this long at most
HINT = "The tool call in this reply fails. The tool said:\n{evidence}"


@dataclass(frozen=True)
class Verdict:
    """What one rule read in one tool result: passed or not, and where in the text it said so."""

    passed: bool
    end: int  # the end of the text that told (the evidence is the output up to here)


# ---- test_summary ----

_PYTEST = re.compile(r"^=*\s*((?:\d+ (?:passed|failed|errors?|skipped|xfailed|xpassed|warnings?|deselected)"
                     r"(?:, )?)+) in [\d.]+s\b.*$", re.M)
_UNITTEST = re.compile(r"^Ran (\d+) tests? in [\d.]+s\s*\n\s*\n(OK|FAILED \(.*\))", re.M)
_CARGO = re.compile(r"^test result: (ok|FAILED)\. (\d+) passed; (\d+) failed;.*$", re.M)
_JEST = re.compile(r"^Tests:\s+(.*\d+ total)$", re.M)
_VITEST = re.compile(r"^\s*Tests\s+(.*\(\d+\))\s*$", re.M)
_NODE_TAP = re.compile(r"^# pass (\d+)\n# fail (\d+)$", re.M)
_GO = re.compile(r"^(?:(FAIL)\t\S+\t|(ok)  \t\S+\t)(?:[\d.]+s|\(cached\)).*$", re.M)


def _count(text: str, word: str) -> int:
    return sum(int(n) for n in re.findall(rf"(\d+) {word}", text))


def _test_summary(text: str) -> Verdict | None:
    found: list[tuple[int, int, int]] = []  # (end, passed, failed) of each summary line
    for m in _PYTEST.finditer(text):
        found.append((m.end(), _count(m[1], "passed"), _count(m[1], "failed") + _count(m[1], "errors?")))
    for m in _UNITTEST.finditer(text):
        failed = int(m[2].startswith("FAILED"))
        found.append((m.end(), int(m[1]) - failed, failed))
    for m in _CARGO.finditer(text):
        found.append((m.end(), int(m[2]), int(m[3]) or int(m[1] == "FAILED")))
    for m in list(_JEST.finditer(text)) + list(_VITEST.finditer(text)):
        found.append((m.end(), _count(m[1], "passed"), _count(m[1], "failed")))
    for m in _NODE_TAP.finditer(text):
        found.append((m.end(), int(m[1]), int(m[2])))
    for m in _GO.finditer(text):
        found.append((m.end(), int(bool(m[2])), int(bool(m[1]))))
    if not found:
        return None
    end = max(e for e, _, _ in found)
    if any(f for _, _, f in found):
        return Verdict(False, end)
    return Verdict(True, end) if any(p for _, p, _ in found) else None


# ---- error_object ----

def _json_object(text: str) -> JsonObject | None:
    stripped = text.strip()
    if not stripped.startswith("{"):
        return None
    try:
        value = json.loads(stripped)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _error_object(text: str) -> Verdict | None:
    obj = _json_object(text)
    if obj is None:
        return None
    error = obj.get("error")
    if obj.get("status") in ("error", "failed") or (isinstance(error, (str, dict)) and error):
        return Verdict(False, len(text))
    return None


# ---- traceback ----

_PY_TRACEBACK = re.compile(r"^Traceback \(most recent call last\):\n(?:[ \t].*\n)+([A-Za-z_][\w.]*(?::.*)?)$", re.M)
_JS_STACK = re.compile(r"^(?:Uncaught )?([A-Z]\w*(?:Error|Exception)(?: \[\w+\])?(?::.*)?)\n(?:\s+at .+(?:\n|$))+", re.M)


def _traceback(text: str) -> Verdict | None:
    ends = [m.end() for pattern in (_PY_TRACEBACK, _JS_STACK) for m in pattern.finditer(text)]
    return Verdict(False, max(ends)) if ends else None


# ---- exit_code ----

_EXITED = re.compile(r"\(Command exited with code (\d+)\)\s*$")
_EXEC_FAILED = re.compile(r"(?:^|\n\n)Command (?:not found|not executable \(permission denied\)|timed out|aborted)\b"
                          r"[^\n]*")
EXIT_FIELDS = ("exitCode", "exit_code", "returncode")


def _exit_code(text: str) -> Verdict | None:
    m = _EXITED.search(text)
    if m:
        return Verdict(int(m[1]) == 0, m.end())
    failed = list(_EXEC_FAILED.finditer(text))
    if failed:
        return Verdict(False, failed[-1].end())
    obj = _json_object(text)
    code = next((obj[f] for f in EXIT_FIELDS if obj is not None and type(obj.get(f)) is int), None)
    return None if code is None else Verdict(code == 0, len(text))


# ---- unknown_tool ----

_UNKNOWN_TOOL = re.compile(r"\s*Tool \S+ not found\s*")


def _unknown_tool(text: str) -> Verdict | None:
    return Verdict(False, len(text)) if _UNKNOWN_TOOL.fullmatch(text) else None


RULES: dict[str, Callable[[str], Verdict | None]] = {
    "test_summary": _test_summary, "error_object": _error_object, "traceback": _traceback, "exit_code": _exit_code,
    "unknown_tool": _unknown_tool}


def evidence(text: str, end: int, limit: int = EVIDENCE_CHARS) -> str:
    """The output up to `end`, its last `limit` characters, starting at a line."""
    head = text[:end].rstrip()
    if len(head) <= limit:
        return head.strip()
    tail = head[-limit:]
    cut = tail.find("\n")
    return (tail[cut + 1:] if 0 <= cut < len(tail) - 1 else tail).strip()


def content_text(content: object) -> str:
    """A message's content as text (OpenAI content may be a list of parts)."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def read_result(text: str, rules: Sequence[str]) -> tuple[str, Verdict] | None:
    """The first of `rules` that recognises this tool result, and its verdict."""
    for name in rules:
        verdict = RULES[name](text)
        if verdict is not None:
            return name, verdict
    return None


def tool_outcome(next_state: Sequence[JsonObject] | None, rules: Sequence[str], success_reward: float,
                 failure_reward: float) -> Outcome | None:
    """The outcome the tool results in a call's next state state, or None when none states one."""
    verdicts = []
    for message in next_state or ():
        if message.get("role") == "tool":
            text = content_text(message.get("content"))
            read = read_result(text, rules)
            if read is not None:
                verdicts.append((read[0], read[1], text))
    failures = [(name, evidence(text, v.end)) for name, v, text in verdicts if not v.passed]
    if failures:
        return Outcome(reward=failure_reward, origin=failures[0][0],
                       text=HINT.format(evidence="\n\n".join(e for _, e in failures)))
    return Outcome(reward=success_reward, origin=verdicts[0][0]) if verdicts else None
