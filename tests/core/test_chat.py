"""Rendering requests to exact prompt ids and reading replies back (tool calls, stops, UTF-8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from clawback.chat import ChatRenderer, ChatRequest
from clawback.replies import IncrementalDetokenizer, TextGate, parse_tool_calls


@pytest.fixture(scope="module")
def tokenizer(embedded_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model_dir))


def req(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def test_render_uses_the_chat_template_and_ids_match_text(tokenizer):
    text, ids = ChatRenderer(tokenizer).render(req(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
    ]))
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")  # developer renders as system
    assert "part one\npart two" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(ids) == text


def test_tools_and_tool_history_in_a_template_without_tool_support(tokenizer):
    r = ChatRenderer(tokenizer)
    assert not r.native_tools
    messages = [
        {"role": "user", "content": "find x"},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{\"q\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "x=1"},
    ]
    text, _ = r.render(req(messages=messages, tools=TOOLS))
    assert "<tools>" in text and '"name": "lookup"' in text
    assert 'Looking.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>' in text
    assert "<|im_start|>tool\nx=1<|im_end|>" in text
    none_text, _ = r.render(req(messages=messages, tools=TOOLS, tool_choice="none"))
    assert "<tools>" not in none_text
    forced, _ = r.render(req(messages=messages, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "lookup"}}))
    assert "You must call the function lookup." in forced


def test_parse_tool_calls():
    content, calls = parse_tool_calls('Sure.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>')
    assert content == "Sure."
    assert [c["function"] for c in calls] == [{"name": "lookup", "arguments": '{"q": "x"}'}]
    assert calls[0]["id"].startswith("call_")
    # two calls, the last one cut off before its closing tag but complete JSON
    _, calls = parse_tool_calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"k": 1}}')
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    # not JSON: kept as content, nothing lost
    content, calls = parse_tool_calls("<tool_call>not json</tool_call> ok")
    assert calls == [] and content == "<tool_call>not json</tool_call> ok"
    assert parse_tool_calls("plain") == ("plain", [])


def test_a_reply_that_is_only_a_bare_json_call_of_a_given_tool_is_a_call():
    """As Qwen2.5-Coder-0.5B answers the gate's tool probes (bench/results/models-*.json)."""
    names = {"get_weather"}
    for text in ('{"name": "get_weather", "arguments": {"city": "Paris"}}',
                 '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'):
        content, calls = parse_tool_calls(text, names)
        assert content is None and [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    for text, given in (('{"name": "get_weather", "arguments": {"city": "Paris"}}', set()),  # no tools offered
                        ('Call {"name": "get_weather", "arguments": {}}', names),  # text around it
                        ('{"name": "get_weather", "arguments": "Paris"}', names),  # arguments not an object
                        ('{"name": "get_weather", "arguments": {"city": "Par', names),  # cut off
                        ('```python\nprint(1)\n```', names)):
        assert parse_tool_calls(text, given) == (text, []), text


def test_calls_written_without_tags_in_other_wrappings_are_calls():
    """Replies of Qwen2.5-Coder-0.5B to the shell scenario (bench/results/grid-q05-abe70a7/shell):
    its calls of `exec` in a plain fence, in <json> tags, several to a reply, or followed by the
    tool's result it imagined."""
    names = {"exec"}
    cases = {
        '<json>\n{\n  "name": "exec",\n  "arguments": {\n    "command": "python3 total.py"\n  }\n}\n</json>':
            (None, ["python3 total.py"]),
        '```\n{"name": "exec", "arguments": {"command": "grep -o city people.csv"}}\n```': (None, ["grep -o city people.csv"]),
        '{"name": "exec", "arguments": {"command": "ls"}}\n{"name": "exec", "arguments": {"command": "wc -l a"}}':
            (None, ["ls", "wc -l a"]),
        '{"name": "exec", "arguments": {"command": "ls"}}\n{"name": "tool_response", "arguments": {"out": "a b"}}':
            ('{"name": "tool_response", "arguments": {"out": "a b"}}', ["ls"]),
    }
    for text, (content, commands) in cases.items():
        got, calls = parse_tool_calls(text, names)
        assert got == content and [json.loads(c["function"]["arguments"])["command"] for c in calls] == commands, text
    for text in ('{"name": "exec", "arguments": "wc -l maple_4.txt"}',  # arguments not an object
                 'Run this: {"name": "exec", "arguments": {"command": "ls"}}',  # prose around it
                 '{"name": "exec", "arguments": {"command": "ls"}} and then I will count them',
                 '```xml\n<tools>{"name": "exec", "arguments": {"command": "ls"}}</tools>\n```'):
        assert parse_tool_calls(text, names) == (text, []), text


def test_a_bare_call_of_a_tool_not_offered_is_a_call_the_agent_can_refuse():
    """Qwen2.5-Coder-0.5B's shell replies (bench/results/shell_base_q05_parse.jsonl) name tools it
    invented; as calls, the agent answers "Tool count_logs not found" and the model may try again."""
    names = {"exec"}
    for text in ('{"name": "count_logs", "arguments": {"command": "ls data/*.log"}}',
                 '<json>{"name": "count_logs", "arguments": {"command": "ls data/*.log"}}</json>',
                 '```json\n{"name": "count_logs", "parameters": {"command": "ls data/*.log"}}\n```'):
        content, calls = parse_tool_calls(text, names)
        assert content is None and [c["function"] for c in calls] == [
            {"name": "count_logs", "arguments": '{"command": "ls data/*.log"}'}], text
    for text, given in (('{"name": "count_logs", "arguments": {"command": "ls"}}', set()),  # no tools offered
                        ('{"name": "Mia", "arguments": {"a": 1}, "age": 7}', names),  # more than a call
                        ('{"name": "wc", "arguments": "maple_4.txt"}', names),  # arguments not an object
                        ('{"name": "Mia", "age": 7}', names)):
        assert parse_tool_calls(text, given) == (text, []), text
    # Beside a call of an offered tool, other objects stay the content (an imagined result, say).
    content, calls = parse_tool_calls('{"name": "exec", "arguments": {"command": "ls"}}\n'
                                      '{"name": "count_logs", "arguments": {"command": "ls"}}', names)
    assert [c["function"]["name"] for c in calls] == ["exec"] and content == '{"name": "count_logs", "arguments": {"command": "ls"}}'


def test_gate_holds_back_possible_stops_and_cuts_at_them():
    g = TextGate(["STOP"], tools=False)
    assert g.feed("abc S") == "abc "  # "S" might start STOP
    assert g.feed("T") == ""
    assert g.feed("x") == "STx"  # it did not
    assert g.feed("yy STOP zz") == "yy "
    assert g.stopped and g.content == "abc STxyy "
    assert g.feed("more") == "" and g.finish() == ""


def test_gate_diverts_tool_calls_out_of_the_stream():
    g = TextGate([], tools=True)
    out = [g.feed(x) for x in ["Hi <to", "ol_call>{\"name\":", " \"f\"}</tool_call>"]] + [g.finish()]
    assert "".join(out) == "Hi "
    assert g.tool_text == '<tool_call>{"name": "f"}</tool_call>'
    g = TextGate([], tools=True)
    assert g.feed("a <to") == "a " and g.finish() == "<to"  # released at the end: it was not a tool call


def test_gate_holds_a_reply_that_opens_like_a_bare_call():
    g = TextGate([], tools=True)
    assert [g.feed(x) for x in [" ", "`", "``", "json\n{", '"name"']] == [""] * 5
    assert g.content == "" and g.tool_text == ' ```json\n{"name"'  # the caller decides at the end
    g = TextGate([], tools=True)
    assert g.feed("``") == "" and g.feed("`py") == "```py"  # a code block, not a call: streamed
    for opening in ("```\n{", "<json>"):
        g = TextGate([], tools=True)
        assert g.feed(opening) == "" and g.tool_text == opening
    g = TextGate([], tools=True)
    assert g.feed("```\n") == "" and g.feed("print(1)") == "```\nprint(1)"
    g = TextGate([], tools=True)
    assert g.feed("<") == "" and g.feed("b>Hi") == "<b>Hi"
    g = TextGate([], tools=True)
    assert g.feed("Sure, ") == "Sure, " and g.feed("{x}") == "{x}"  # a brace later is just text
    g = TextGate([], tools=False)
    assert g.feed('{"a": 1}') == '{"a": 1}'  # no tools: nothing is held


def test_detokenizer_never_splits_characters(tokenizer):
    text = "naïve café — 東京 🚀 done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer)
    pieces = [d.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("bad", [
    {"messages": [{"role": "assistant"}]},
    {"messages": [{"role": "user", "content": "x", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
    {"tool_choice": "required"},
    {"stop": "x", "tools": [{"type": "retrieval"}]},
])
def test_invalid_requests_are_rejected(bad):
    with pytest.raises(ValidationError):
        req(**bad)


def test_metadata_fields_are_stripped_from_the_stored_body():
    body = req(session_id="s", turn_type="main", turn_id="t", session_done=True, user="u-1").openai_body()
    assert not {"session_id", "turn_type", "turn_id", "session_done"} & body.keys()
    assert body["user"] == "u-1"  # unknown OpenAI fields are kept as sent
