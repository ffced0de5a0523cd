"""What a real OpenAI client asks for, against the real daemon on the embedded SmolLM2 model,
through the official `openai` client: structured output and forced tool calls enforced by
constrained decoding, top_logprobs, the adapter version on every response, and a clear 400 for
what is not served (n > 1, images)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

TRIP = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 30}},
        "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                                                           "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                         "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 24}},
                                                        "required": ["tz"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from tests.conftest import DaemonProcess

    d = DaemonProcess(tmp_path_factory.mktemp("api-data"), embedded_model_dir,
                      env={"CLAWBACK_TRAIN__ENABLED": "false", "CLAWBACK_JUDGE__BACKEND": "off"}).start()
    try:
        yield openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=180)
    finally:
        d.stop()


def chat(client: openai.OpenAI, content: str, **kw):
    return client.chat.completions.with_raw_response.create(
        model="clawback", messages=[{"role": "user", "content": content}], **kw)


def test_json_object_and_schema_are_enforced(client: openai.OpenAI):
    raw = chat(client, "Describe a cat.", response_format={"type": "json_object"}, max_tokens=160, temperature=0)
    r = raw.parse()
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)

    # The same request without the constraint is prose: the grammar, not the prompt, made it JSON.
    free = chat(client, "Describe a cat.", max_tokens=24, temperature=0).parse().choices[0].message.content
    with pytest.raises(json.JSONDecodeError):
        json.loads(free)

    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}}
    pieces = []
    for chunk in client.chat.completions.create(
            model="clawback", messages=[{"role": "user", "content": "Plan a trip to Rome."}], stream=True,
            response_format=fmt, max_tokens=64, temperature=0.8, seed=3):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
    jsonschema.validate(json.loads("".join(pieces)), TRIP)


def test_tool_choice_required_and_named_are_enforced(client: openai.OpenAI):
    r = chat(client, "Hello there!", tools=[WEATHER, TIME], tool_choice="required", max_tokens=64,
             temperature=0).parse()
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    call = choice.message.tool_calls[0].function
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.name]
    jsonschema.validate(json.loads(call.arguments), tool["function"]["parameters"])

    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, "What is the weather in Oslo?", tools=[WEATHER, TIME], tool_choice=named, max_tokens=64,
             temperature=1.0, seed=1).parse()
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"], r.choices[0].message
    jsonschema.validate(json.loads(calls[0].function.arguments), TIME["function"]["parameters"])


def test_top_logprobs(client: openai.OpenAI):
    r = chat(client, "Say hi.", logprobs=True, top_logprobs=5, max_tokens=8, temperature=0).parse()
    content = r.choices[0].logprobs.content
    assert content
    for entry in content:
        tops = entry.top_logprobs
        assert len(tops) == 5
        assert [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].token == entry.token and abs(tops[0].logprob - entry.logprob) < 1e-5  # greedy


def test_every_response_names_its_adapter(client: openai.OpenAI):
    raw = chat(client, "Hi", max_tokens=4)
    assert raw.headers["x-clawback-adapter"] == "base" and raw.parse().system_fingerprint == "base"
    with client.chat.completions.with_streaming_response.create(
            model="clawback", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True) as s:
        assert s.headers["x-clawback-adapter"] == "base"
        chunks = list(s.parse())
    assert chunks and all(c.system_fingerprint == "base" for c in chunks)


@pytest.mark.parametrize("kw, param, words", [
    ({"n": 2}, "n", "n > 1"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs", "less than or equal to 20"),
    ({"top_logprobs": 3}, "top_logprobs", "needs logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "cannot enforce"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_object"),
])
def test_unsupported_or_bad_parameters_are_a_clear_400(client: openai.OpenAI, kw: dict, param: str, words: str):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "Hi", max_tokens=4, **kw)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err


def test_images_are_refused_plainly(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="clawback", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}])
    assert e.value.body["message"] == "this model does not accept images"
    assert e.value.body["param"] == "messages.0.content.1"


def test_no_plugin_mode_and_the_untrained_warning(client: openai.OpenAI):
    """OpenClaw's `compat.sendSessionAffinityHeaders` names the session on agent turns only: such a
    call is main and pairs with the next; the untagged calls before it (every test above) made the
    daemon warn that nothing trains, and a main call clears the warning."""
    import httpx

    from tests.conftest import query, wait_for

    base, auth = str(client.base_url).rstrip("/"), {"authorization": f"Bearer {client.api_key}"}
    status = httpx.get(f"{base}/status", headers=auth, timeout=30).json()
    assert any("no main call since the daemon started" in w for w in status["warnings"]), status["warnings"]

    messages = [{"role": "user", "content": "Hi!"}]
    first = client.chat.completions.create(model="clawback", messages=messages, max_tokens=6,
                                           extra_headers={"session_id": "oc-sess-1", "x-session-affinity": "oc-sess-1"})
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "More."}]
    client.chat.completions.create(model="clawback", messages=messages, max_tokens=6,
                                   extra_headers={"x-session-affinity": "oc-sess-1"})
    assert httpx.get(f"{base}/status", headers=auth, timeout=30).json()["warnings"] == []
    db = Path(httpx.get(f"{base}/status", headers=auth, timeout=30).json()["store"]["path"])
    rows = wait_for(lambda: (lambda r: r if len(r) == 2 else None)(query(
        db, "SELECT turn_type, state FROM calls WHERE session_id = 'oc-sess-1' ORDER BY created_at")), what="2 calls")
    assert [tuple(r) for r in rows] == [("main", "paired"), ("main", "awaiting_next_state")]
