"""The judge's pure logic: vote parsing, majority, hint selection, prompt contents, timeouts and
retries. The backend is scripted: it replaces only the judge model's text."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest

from clawback.judge.backends import JudgeBackendError, PromptTooLongError
from clawback.judge.prm import (
    CONTEXT_CHARS,
    HINT_PROMPT,
    REQUEST_CHARS,
    Vote,
    build_messages,
    fill,
    judge_hint,
    judge_prm,
    load_template,
    majority,
    parse_hint,
    parse_score,
    select_hint,
    strip_reasoning,
)


class ScriptedBackend:
    """Answers each call with the next scripted item: a string, an exception to raise, or
    ("sleep", seconds, text) to answer late. Records every call."""

    name = "scripted"

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.calls: list[dict[str, Any]] = []

    async def complete(self, messages, *, temperature, max_tokens, seed=None) -> str:
        self.calls.append({"messages": messages, "temperature": temperature, "max_tokens": max_tokens, "seed": seed})
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, tuple):
            _, seconds, item = item
            await asyncio.sleep(seconds)
        return item


REQUEST = [
    {"role": "system", "content": "You are OpenClaw, a personal agent. SYSTEM-PROMPT-MARKER"},
    {"role": "user", "content": "Convert 5 miles to kilometres."},
]
RESPONSE = "<think>miles times 1.609 SECRET-REASONING</think>5 miles is about 8.05 km."
THANKS = [{"role": "user", "content": "Perfect, thank you!"}]


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- parsing


@pytest.mark.parametrize("text, expected", [
    (r"\boxed{1}", 1),
    (r"\boxed{-1}", -1),
    (r"\boxed{0}", 0),
    (r"\boxed{ -1 }", -1),
    (r"\boxed{+1}", 1),
    (r"\boxed {1}", 1),
    (r"first \boxed{-1}, on reflection \boxed{1}", 1),  # the last box wins
    (r"\boxed{1} ... final: \boxed{2}", None),  # the last box is out of range: failed, no fallback
    (r"\boxed{2}", None),
    (r"\boxed{yes}", None),
    (r"\boxed{1.0}", None),
    (r"\boxed{}", None),
    ("the answer is 1", None),
    ("", None),
])
def test_parse_score(text, expected):
    assert parse_score(text) == expected


def test_hint_scores_are_only_plus_or_minus_one():
    assert parse_hint(r"\boxed{0} [HINT_START]x[HINT_END]")[0] is None
    assert parse_hint(r"\boxed{-1}") == (-1, None)


def test_parse_hint_takes_the_last_block_stripped():
    text = r"\boxed{1} [HINT_START]draft[HINT_END] better: [HINT_START]  Use kilometres, not miles.  [HINT_END]"
    assert parse_hint(text) == (1, "Use kilometres, not miles.")
    assert parse_hint(r"\boxed{1} [HINT_START]   [HINT_END]") == (1, None)
    assert parse_hint(r"\boxed{1} [HINT_START]never closed") == (1, None)


@pytest.mark.parametrize("scores, expected", [
    ([1, 1, -1], 1),
    ([-1, -1, 1], -1),
    ([0, 0, 1], 0),
    ([1, -1, 0], 0),  # three-way tie
    ([1, -1], 0),  # tie
    ([None, None, -1], -1),  # failed votes are dropped
    ([None, 1, -1], 0),  # a tie among the valid ones
    ([None, None, None], None),  # nothing valid: a failed verdict, not a 0
    ([], None),
])
def test_majority(scores, expected):
    assert majority(scores) == expected


def vote(score, hint=None):
    return Vote(score=score, raw="", prompt_version="hint_v1", hint=hint)


def test_select_hint_longest_over_ten_chars_among_positive_votes():
    votes = [
        vote(1, "Answer in km."),
        vote(-1, "A much longer hint from a vote that said there was no guidance at all."),
        vote(1, "Answer in kilometres and show the formula."),
        vote(None, "An even longer hint from a vote that failed to give a valid score."),
    ]
    assert select_hint(votes) == "Answer in kilometres and show the formula."
    assert select_hint([vote(1, "Too short."), vote(1, None), vote(-1, "Long enough but negative")]) is None


# ---------------------------------------------------------------- voting


def test_majority_of_three_votes():
    backend = ScriptedBackend(r"good \boxed{1}", r"bad \boxed{-1}", r"\boxed{1}")
    verdict = run(judge_prm(backend, REQUEST, RESPONSE, THANKS, m=3, temperature=0.6, seed=10))
    assert verdict.score == 1
    assert [v.score for v in verdict.votes] == [1, -1, 1]
    assert verdict.prompt_version == "prm_v1" and all(v.prompt_version == "prm_v1" for v in verdict.votes)
    assert verdict.backend == "scripted" and verdict.failed_votes == 0
    assert sorted(c["seed"] for c in backend.calls) == [10, 11, 12]  # one distinct seed per vote
    assert {c["temperature"] for c in backend.calls} == {0.6}


def test_all_votes_failing_is_a_failed_verdict():
    backend = ScriptedBackend("no box", r"\boxed{5}", JudgeBackendError("server down"))
    verdict = run(judge_prm(backend, REQUEST, RESPONSE, THANKS, m=3, retries=0))
    assert verdict.score is None and verdict.failed_votes == 3
    errors = sorted(v.error for v in verdict.votes)
    assert errors[0] == "JudgeBackendError: server down"
    assert all("boxed" in e for e in errors[1:])
    assert {v.raw for v in verdict.votes} == {"no box", r"\boxed{5}", ""}


@pytest.mark.parametrize("m", [0, 2, 4, -1])
def test_m_must_be_odd(m):
    with pytest.raises(ValueError, match="odd"):
        run(judge_prm(ScriptedBackend(), REQUEST, RESPONSE, THANKS, m=m))


def test_a_slow_vote_times_out_and_its_retry_answers():
    backend = ScriptedBackend(("sleep", 5.0, r"\boxed{-1}"), r"\boxed{1}")
    verdict = run(judge_prm(backend, REQUEST, RESPONSE, THANKS, m=1, timeout_s=0.1, retries=1))
    assert verdict.score == 1
    assert verdict.votes[0].attempts == 2 and verdict.votes[0].seconds < 2


def test_a_vote_that_times_out_on_every_attempt_fails_with_the_reason():
    backend = ScriptedBackend(("sleep", 5.0, r"\boxed{1}"))
    verdict = run(judge_prm(backend, REQUEST, RESPONSE, THANKS, m=1, timeout_s=0.1, retries=0))
    assert verdict.score is None
    assert verdict.votes[0].error == "timed out after 0.1s"


def test_unparseable_replies_and_errors_are_retried():
    backend = ScriptedBackend("I think it is fine.", RuntimeError("boom"), r"\boxed{-1}")
    verdict = run(judge_prm(backend, REQUEST, RESPONSE, THANKS, m=1, retries=2))
    assert verdict.score == -1 and verdict.votes[0].attempts == 3 and len(backend.calls) == 3


def test_a_prompt_too_long_is_not_retried():
    backend = ScriptedBackend(PromptTooLongError("judge prompt is 9000 tokens"), r"\boxed{1}")
    verdict = run(judge_prm(backend, REQUEST, RESPONSE, THANKS, m=1, retries=3))
    assert verdict.score is None and verdict.votes[0].error == "judge prompt is 9000 tokens"
    assert len(backend.calls) == 1


def test_judge_hint_selects_the_hint_and_votes():
    backend = ScriptedBackend(
        r"\boxed{1} [HINT_START]Give the result in kilometres.[HINT_END]",
        r"\boxed{1} [HINT_START]Give the result in kilometres, rounded to one decimal.[HINT_END]",
        r"\boxed{-1}",
    )
    correction = [{"role": "user", "content": "Round it to one decimal, please."}]
    verdict = run(judge_hint(backend, REQUEST, RESPONSE, correction, m=3))
    assert verdict.score == 1
    assert verdict.hint == "Give the result in kilometres, rounded to one decimal."
    assert verdict.prompt_version == "hint_v1"


# ---------------------------------------------------------------- what the judge reads


def user_prompt(messages: list[dict[str, str]]) -> str:
    assert [m["role"] for m in messages] == ["system", "user"]
    return messages[1]["content"]


def test_prm_prompt_shows_request_stripped_response_and_next_state_role():
    next_state = [{"role": "tool", "name": "convert", "content": "8.05"}]
    messages = build_messages(REQUEST, RESPONSE, next_state)
    prompt = user_prompt(messages)
    assert "Convert 5 miles to kilometres." in prompt
    assert "5 miles is about 8.05 km." in prompt
    assert "SECRET-REASONING" not in prompt and "<think>" not in prompt
    assert "(role: tool)" in prompt and "[tool result from convert]\n8.05" in prompt
    assert "SYSTEM-PROMPT-MARKER" not in prompt  # agent system prompts are not the request
    assert r"\boxed{1}" in messages[0]["content"] and r"\boxed{-1}" in messages[0]["content"]


def test_hint_prompt_takes_explicit_feedback_as_a_user_message():
    prompt = user_prompt(build_messages(REQUEST, RESPONSE, "Use miles per hour next time.", HINT_PROMPT))
    assert "(role: user)" in prompt and "Use miles per hour next time." in prompt
    assert "Convert 5 miles to kilometres." in prompt and "SECRET-REASONING" not in prompt


def hint_messages(*args: Any, **kw: Any) -> list[dict[str, str]]:
    return build_messages(*args, prompt_version=HINT_PROMPT, **kw)


def test_user_text_with_braces_is_inserted_verbatim():
    request = [{"role": "user", "content": "Format {x} and {request} and {0} and }{ in Python"}]
    response = "Use f'{x!r}' or '{}'.format(x)"
    next_state = [{"role": "user", "content": "What about {next_state}?"}]
    for build in (build_messages, hint_messages):
        prompt = user_prompt(build(request, response, next_state))
        assert "Format {x} and {request} and {0} and }{ in Python" in prompt
        assert "Use f'{x!r}' or '{}'.format(x)" in prompt
        assert "What about {next_state}?" in prompt


def test_fill_rejects_an_unknown_placeholder():
    assert fill("a {name} b {c d} \\boxed{1}", {"name": "{name}"}) == "a {name} b {c d} \\boxed{1}"
    with pytest.raises(KeyError, match="missing"):
        fill("{missing}", {})


def test_templates_fill_every_placeholder():
    for version in ("prm_v1", "hint_v1"):
        template = load_template(version)
        assert template.version == version
        for messages in (build_messages(REQUEST, RESPONSE, THANKS), build_messages(REQUEST, RESPONSE, THANKS, HINT_PROMPT)):
            for m in messages:
                assert not re.search(r"\{[a-z_]+\}", m["content"]), m["content"]


def test_a_judge_that_parrots_the_prompt_gives_no_reward_and_no_hint():
    # Small judges often echo the instructions; the last box they echo must be the harmless one.
    for message in build_messages(REQUEST, RESPONSE, THANKS):
        assert parse_score(message["content"]) == 0
    for message in build_messages(REQUEST, RESPONSE, THANKS, HINT_PROMPT):
        score, hint = parse_hint(message["content"])
        assert score == -1
        assert select_hint([Vote(score=1, raw="", prompt_version="hint_v1", hint=hint)]) is None


def test_tool_loop_request_and_readable_tool_calls():
    messages = [
        {"role": "user", "content": "What is in notes.txt?"},
        {"role": "assistant", "content": "<think>look</think>", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "notes.txt"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "buy milk"},
    ]
    response = '<tool_call>\n{"name": "summarise", "arguments": {"text": "buy milk"}}\n</tool_call>'
    prompt = user_prompt(build_messages(messages, response, [{"role": "tool", "content": "ok"}]))
    request_section = prompt.split("## The user's request\n", 1)[1]
    assert request_section.startswith("What is in notes.txt?")
    assert '[calls tool read_file with {"path": "notes.txt"}]' in prompt
    assert "[tool result from c1]\nbuy milk" in prompt
    assert '[calls tool summarise with {"text": "buy milk"}]' in prompt and "<tool_call>" not in prompt
    assert "look" not in prompt


def test_context_is_bounded_in_messages_and_characters():
    old = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"OLD-{i} " + "x" * 50} for i in range(10)]
    huge_tool = {"role": "tool", "name": "dump", "content": "y" * 50_000}
    messages = [*old, {"role": "user", "content": "R" * 10_000}, huge_tool]
    prompt = user_prompt(build_messages(messages, "done", THANKS))
    assert "OLD-9" in prompt and "OLD-7" in prompt and "OLD-6" not in prompt  # 4 messages: tool + OLD-9..7
    longest_run = lambda ch: max(len(run) for run in re.findall(f"{ch}+", prompt))  # noqa: E731
    assert 1000 < longest_run("R") <= REQUEST_CHARS and "characters cut" in prompt
    assert 500 < longest_run("y") <= CONTEXT_CHARS // 2
    template_chars = len(user_prompt(build_messages([{"role": "user", "content": ""}], "", [])))
    assert len(prompt) < template_chars + REQUEST_CHARS + CONTEXT_CHARS + 500


def test_content_parts_are_read():
    request = [{"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]}]
    prompt = user_prompt(build_messages(request, "ok", THANKS))
    assert "part one\npart two" in prompt


@pytest.mark.parametrize("text, expected", [
    ("<think>plan</think>Answer", "Answer"),
    ("<think>a</think>One <think>b</think>Two", "One Two"),
    ("still thinking</think>\nAnswer", "Answer"),  # the template opened <think> in the prompt
    ("Answer<think>cut off mid-thought", "Answer"),
    ("No reasoning at all", "No reasoning at all"),
])
def test_strip_reasoning(text, expected):
    assert strip_reasoning(text) == expected


def test_response_only_context_hides_the_request_like_the_seed_judge():
    for build in (build_messages, hint_messages):
        prompt = user_prompt(build(REQUEST, RESPONSE, THANKS, context="response_only"))
        assert "Convert 5 miles to kilometres." not in prompt
        assert "5 miles is about 8.05 km." in prompt and "(not shown to the judge)" in prompt
    with pytest.raises(ValueError, match="judge context"):
        build_messages(REQUEST, RESPONSE, THANKS, context="everything")
