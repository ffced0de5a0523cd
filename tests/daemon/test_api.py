"""The HTTP API of a real daemon process (tiny random Llama with SmolLM2's tokenizer): auth,
OpenAI shapes, streaming, tools, and bad input that must get a 4xx and change nothing."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.conftest import DaemonProcess, query, wait_for


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess(tmp_path_factory.mktemp("api-data"), tiny_model_dir, "--served-model-name", "policy")
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon: DaemonProcess):
    with httpx.Client(base_url=daemon.url, headers={"authorization": f"Bearer {daemon.api_key}"}, timeout=60) as c:
        yield c


def chat(**kw):
    return {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **kw}


def test_health_is_open_everything_else_needs_the_key(daemon: DaemonProcess):
    assert httpx.get(f"{daemon.url}/healthz").json() == {"ok": True}
    for path in ("/v1/models", "/metrics", "/v1/status"):
        r = httpx.get(f"{daemon.url}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{daemon.url}/v1/chat/completions", json=chat(), headers={"authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "invalid API key"
    key_file = daemon.data_dir / "api_key"
    assert key_file.stat().st_mode & 0o077 == 0, "the key file must be private"
    assert daemon.api_key not in daemon.log.read_text(), "secrets never in logs"


def test_models_reports_context_length(client: httpx.Client):
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == ["policy"]
    assert data[0]["context_length"] == 512


def test_completion_shape_and_usage(client: httpx.Client):
    r = client.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=7))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "policy"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert body["usage"]["completion_tokens"] <= 7
    assert r.headers["x-clawback-call-id"] == body["id"]


def test_greedy_is_deterministic_and_seed_reproduces_sampling(client: httpx.Client):
    a = client.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=12)).json()
    b = client.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=12)).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    s1 = client.post("/v1/chat/completions", json=chat(temperature=1.0, seed=7, max_tokens=12)).json()
    s2 = client.post("/v1/chat/completions", json=chat(temperature=1.0, seed=7, max_tokens=12)).json()
    assert s1["choices"][0]["message"] == s2["choices"][0]["message"]


def sse_events(r: httpx.Response) -> list:
    events = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def test_stream_real_deltas_usage_and_done(client: httpx.Client):
    body = chat(temperature=0, max_tokens=12, stream=True, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finish = chunks[-1]["choices"][0]
    assert finish["finish_reason"] in ("stop", "length") and finish["delta"] == {}
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    whole = client.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=12)).json()
    assert streamed == whole["choices"][0]["message"]["content"]
    content_chunks = [c for c in chunks[1:-1] if c["choices"][0]["delta"].get("content")]
    assert len(content_chunks) > 1, "real streaming sends many deltas, not one"


def test_stop_sequence_is_cut_and_not_returned(client: httpx.Client):
    full = client.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=20)).json()
    text = full["choices"][0]["message"]["content"]
    assert len(text) >= 4
    stop = text[2:4]
    r = client.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=20, stop=[stop])).json()
    assert r["choices"][0]["message"]["content"] == text[: text.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tool_history_renders_and_tools_reach_the_prompt(client: httpx.Client, daemon: DaemonProcess):
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    r = client.post("/v1/chat/completions", json=chat(messages=messages, tools=TOOLS, tool_choice="auto"),
                    headers={"x-session-id": "tools-1", "x-turn-type": "main"})
    assert r.status_code == 200, r.text
    call_id = r.json()["id"]
    prompt = _wait_for_call(daemon, call_id)["prompt_text"]
    assert "get_weather" in prompt and "<tools>" in prompt  # tools rendered into the system turn
    assert '"city": "Paris"' in prompt and "sunny, 21C" in prompt  # earlier call and result kept


def _wait_for_call(daemon: DaemonProcess, call_id: str) -> dict:
    rows = wait_for(lambda: query(daemon.data_dir / "clawback.db", "SELECT * FROM calls WHERE call_id = ?", call_id),
                    what=f"call {call_id} stored")
    return dict(rows[0])


BAD = [
    ("not json", b"{nope", 400, "invalid_json"),
    ("array body", b"[1,2]", 400, "invalid_json"),
    ("no messages", {"model": "policy", "messages": []}, 400, "invalid_value"),
    ("unknown role", chat(messages=[{"role": "wizard", "content": "x"}]), 400, "invalid_value"),
    ("user without content", chat(messages=[{"role": "user"}]), 400, "invalid_value"),
    ("image part", chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "images_not_supported"),
    ("temperature too high", chat(temperature=3), 400, "invalid_value"),
    ("negative temperature", chat(temperature=-0.1), 400, "invalid_value"),
    ("top_p zero", chat(top_p=0), 400, "invalid_value"),
    ("max_tokens zero", chat(max_tokens=0), 400, "invalid_value"),
    ("n two", chat(n=2), 400, "unsupported_parameter"),
    ("five stops", chat(stop=["a", "b", "c", "d", "e"]), 400, "invalid_value"),
    ("empty stop", chat(stop=[""]), 400, "invalid_value"),
    ("tool without function", chat(tools=[{"type": "function"}]), 400, "invalid_value"),
    ("tool bad name", chat(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400, "invalid_value"),
    ("tool params not object", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]), 400, "invalid_value"),
    ("duplicate tools", chat(tools=TOOLS + TOOLS), 400, "invalid_value"),
    ("tool_choice unknown", chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), 400, "invalid_value"),
    ("bad turn type", chat(turn_type="primary"), 400, "invalid_value"),
    ("deep nesting", b'{"model": "policy", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_json"),
    ("nesting over 64", json.dumps(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": json.loads('{"x":' * 70 + "1" + "}" * 70)}}}}])).encode(), 400, "invalid_json"),
    ("int over 4300 digits", b'{"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
     + b"9" * 5000 + b"}", 400, "invalid_json"),
    ("NaN", b'{"model": "policy", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, "invalid_json"),
    ("seed over 64 bits", chat(seed=2**64), 400, "invalid_value"),
    ("seed under 64 bits", chat(seed=-(2**63) - 1), 400, "invalid_value"),
    ("lone surrogate in content", b'{"model": "policy", "messages": [{"role": "user", "content": "a\\ud800b"}]}', 400,
     "invalid_json"),
    ("lone surrogate in session_id", b'{"model": "policy", "session_id": "\\udfff", "messages": [{"role": "user", "content": "hi"}]}',
     400, "invalid_json"),
    ("non-ASCII request_id", chat(request_id="r\u0100\u20ac"), 400, "invalid_value"),
    ("stream as a string", chat(stream="yes"), 400, "invalid_value"),
    ("stream as a number", chat(stream=1), 400, "invalid_value"),
    ("temperature as a boolean", chat(temperature=True), 400, "invalid_value"),
    ("max_tokens as a string", chat(max_tokens="5"), 400, "invalid_value"),
    ("logprobs as a string", chat(logprobs="true"), 400, "invalid_value"),
    ("session_done as a string", chat(session_done="yes"), 400, "invalid_value"),
    ("unknown field", chat(frobnicate=1), 400, "unknown_parameter"),
    ("logit_bias", chat(logit_bias={"42": 100}), 400, "unsupported_parameter"),
    ("presence_penalty", chat(presence_penalty=1.5), 400, "unsupported_parameter"),
    ("no parallel tool calls", chat(tools=TOOLS, parallel_tool_calls=False), 400, "unsupported_parameter"),
    ("lone surrogate as raw bytes", b'{"model": "policy", "user": "x\xed\xa0\x80", "messages": [{"role": "user", '
     b'"content": "hi"}]}', 400, "invalid_json"),
    ("lone surrogate as raw bytes in content", b'{"model": "policy", "messages": [{"role": "user", '
     b'"content": "a\xed\xbf\xbfb"}]}', 400, "invalid_json"),
    ("Latin-1 bytes", b'{"model": "policy", "messages": [{"role": "user", "content": "caf\xe9"}]}', 400, "invalid_json"),
    ("recursive response_format schema", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"$ref": "#"}}}), 400, "invalid_schema"),
    ("recursive tool schema", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}],
                                   tool_choice="required"), 400, "invalid_schema"),
    ("mutually recursive $defs", chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
        "$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}},
                  "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}}}}}}), 400, "invalid_schema"),
    ("unknown model", chat(model="gpt-9"), 404, "model_not_found"),
    ("prompt over context", chat(messages=[{"role": "user", "content": "word " * 600}]), 400, "context_length_exceeded"),
]


@pytest.mark.parametrize("name,body,status,code", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_a_clear_4xx_and_stores_nothing(client: httpx.Client, daemon: DaemonProcess, name, body, status, code):
    before = client.get("/v1/status").json()["store"]
    headers = {"x-session-id": "bad", "x-turn-type": "main"}
    if isinstance(body, dict) and "turn_type" in body:
        headers.pop("x-turn-type")  # headers win over body fields; let the body's value count
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = client.post("/v1/chat/completions", headers=headers, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    after = client.get("/v1/status").json()["store"]
    assert after["calls"] == before["calls"] and after["written"] == before["written"]


def test_fields_that_ask_for_nothing_are_accepted_and_stored(client: httpx.Client, daemon: DaemonProcess):
    body = chat(user="u-1", store=False, metadata={"k": "v"}, logit_bias={}, presence_penalty=0, frequency_penalty=0.0,
                parallel_tool_calls=True, session_done=False)
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    stored = json.loads(_wait_for_call(daemon, r.headers["x-clawback-call-id"])["request_json"])
    assert stored["user"] == "u-1" and stored["metadata"] == {"k": "v"}


def test_a_long_request_id_header_is_refused(client: httpx.Client):
    r = client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "r" * 60_000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
    r = client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": "r" * 256})
    assert r.status_code == 200 and r.headers["x-request-id"] == "r" * 256


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
@pytest.mark.parametrize("note_id", ["99999999999999999999999999", "9223372036854775808", "0", "-1"])
def test_a_note_id_out_of_range_is_a_4xx(client: httpx.Client, method: str, note_id: str):
    r = client.request(method, f"/v1/memory/{note_id}", json={"text": "Be brief."})
    assert r.status_code == 400 and r.json()["error"]["param"] == "note_id", r.text


@pytest.mark.parametrize("value", ["yes", 1, "on", "TRUE", "true", 0, None, []])
def test_forget_all_takes_a_json_true_only(client: httpx.Client, daemon: DaemonProcess, value):
    """Anything but JSON true for `all` is a 400 that deletes nothing."""
    r = client.post("/v1/chat/completions", json=chat(), headers={"x-session-id": "kept", "x-turn-type": "main"})
    assert r.status_code == 200
    _wait_for_call(daemon, r.headers["x-clawback-call-id"])
    r = client.post("/v1/forget", json={"all": value})
    assert r.status_code == 400, r.text
    assert query(daemon.data_dir / "clawback.db", "SELECT * FROM sessions WHERE session_id = 'kept'")


@pytest.mark.parametrize("body", [{"version": True}, {"version": "base", "force": "yes"}, {"version": "base", "force": 1}])
def test_adapter_routes_take_json_booleans_only(client: httpx.Client, body: dict):
    r = client.post("/v1/adapters/rollback", json=body)
    assert r.status_code == 400, r.text


def test_a_client_that_leaves_a_non_streamed_request_stops_its_generation(daemon: DaemonProcess):
    """Without a stream the daemon still watches the connection: closed, the engine stops and
    what was generated is stored as a cancelled call."""
    import socket

    body = json.dumps(chat(max_tokens=480, temperature=1.0, request_id="leaves-early")).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {daemon.api_key}\r\nx-session-id: leaver\r\nx-turn-type: main\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    status = httpx.Client(base_url=daemon.url, headers={"authorization": f"Bearer {daemon.api_key}"}, timeout=60)
    with status, socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as sock:
        sock.sendall(head + body)
        wait_for(lambda: status.get("/v1/status").json()["generations_running"] > 0, interval=0.01,
                 what="the generation running")
    db = daemon.data_dir / "clawback.db"
    (call,) = wait_for(lambda: query(db, "SELECT * FROM calls WHERE request_id = 'leaves-early'"), what="the call stored")
    assert call["finish_reason"] == "cancelled"
    assert json.loads(call["timings_json"])["completion_tokens"] < 480


def test_tiny_temperature_and_top_p_sample_the_top_token(client: httpx.Client):
    greedy = client.post("/v1/chat/completions", json=chat(temperature=0, max_tokens=8)).json()
    for kw in ({"temperature": 1e-300}, {"temperature": 5e-324, "top_p": 5e-324}, {"top_p": 1e-300}):
        r = client.post("/v1/chat/completions", json=chat(max_tokens=8, **kw))
        assert r.status_code == 200, (kw, r.text)
        if "temperature" in kw:
            assert r.json()["choices"][0]["message"] == greedy["choices"][0]["message"]


def test_a_refused_stream_leaves_no_generation_running(client: httpx.Client):
    """A streamed call whose request id could not go in a header stayed counted as running."""
    for _ in range(3):
        r = client.post("/v1/chat/completions", json=chat(stream=True, request_id="r\u00e9\u0100"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
    assert client.get("/v1/status").json()["generations_running"] == 0


def test_a_client_that_hangs_up_mid_stream_stops_its_generation(client: httpx.Client, daemon: DaemonProcess):
    """The daemon notices the closed connection and stops the engine: the call is stored as
    cancelled after fewer tokens than it had room for, and nothing is left running."""
    with client.stream("POST", "/v1/chat/completions", json=chat(stream=True, max_tokens=480)) as r:
        call_id = r.headers["x-clawback-call-id"]
        next(r.iter_lines())  # the first chunk; then the connection closes
    call = _wait_for_call(daemon, call_id)
    assert call["finish_reason"] == "cancelled"
    assert json.loads(call["timings_json"])["completion_tokens"] < 480
    wait_for(lambda: client.get("/v1/status").json()["generations_running"] == 0, what="no generation running")


def test_body_over_limit_is_413(client: httpx.Client):
    big = chat(messages=[{"role": "user", "content": "x" * (4 * 1024 * 1024 + 10)}])
    r = client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method_are_openai_errors(client: httpx.Client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_metrics_count_requests_and_tokens(client: httpx.Client):
    client.post("/v1/chat/completions", json=chat(max_tokens=3))
    text = client.get("/metrics").text
    assert 'clawback_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert 'clawback_tokens_total{kind="completion"}' in text
    assert "clawback_store_queue_depth" in text
    assert "clawback_time_to_first_token_seconds_bucket" in text


def test_max_tokens_is_clamped_to_the_room_left(client: httpx.Client):
    r = client.post("/v1/chat/completions", json=chat(max_tokens=100_000, temperature=0))
    assert r.status_code == 200
    assert r.json()["usage"]["total_tokens"] <= 512


def test_logprobs_are_the_recorded_behaviour_logprobs(client: httpx.Client, daemon: DaemonProcess):
    from clawback.daemon.store import blob_logprobs

    r = client.post("/v1/chat/completions", json=chat(max_tokens=6, logprobs=True)).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    stored = blob_logprobs(_wait_for_call(daemon, r["id"])["behaviour_logprobs"])
    assert [c["logprob"] for c in content] == pytest.approx(stored, abs=1e-6)
    with client.stream("POST", "/v1/chat/completions", json=chat(max_tokens=6, logprobs=True, stream=True)) as s:
        events = sse_events(s)
    final = events[-2]["choices"][0]
    assert final["finish_reason"] and len(final["logprobs"]["content"]) >= 1
    assert client.post("/v1/chat/completions", json=chat(logprobs=True, top_logprobs=21)).status_code == 400
