"""Property-based run over the daemon's OpenAPI schema (schemathesis, on hypothesis): requests
generated from the request models, valid and invalid, against a real daemon process (tiny random
Llama), on every route the schema describes. No input may give a 5xx; the run is bounded by
example counts (a minute or two on a busy 2-core machine)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import DaemonProcess

# Every operation in /openapi.json, with how many generated requests it gets: more where the body
# is large (chat, feedback), a few where there is little to vary.
EXAMPLES = {
    ("/v1/chat/completions", "POST"): 60, ("/v1/feedback", "POST"): 60, ("/v1/forget", "POST"): 30,
    ("/v1/adapters/rollback", "POST"): 15, ("/v1/adapters/pin", "POST"): 15, ("/v1/adapters/promote", "POST"): 15,
    ("/v1/adapters/prune", "POST"): 3, ("/v1/adapters", "GET"): 3, ("/v1/memory/{note_id}", "PUT"): 20,
    ("/v1/memory/{note_id}", "PATCH"): 20, ("/v1/memory/{note_id}", "DELETE"): 15, ("/v1/memory", "GET"): 3, ("/v1/memory", "DELETE"): 3,
    ("/v1/dashboard/link", "POST"): 3, ("/v1/models", "GET"): 3, ("/v1/status", "GET"): 3, ("/metrics", "GET"): 3,
    ("/healthz", "GET"): 3,
}
BODIES = ("/v1/chat/completions", "/v1/feedback", "/v1/forget")  # where some of the generated requests must pass


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess(tmp_path_factory.mktemp("fuzz-data"), tiny_model_dir, env={
        "CLAWBACK_TRAIN__ENABLED": "false", "CLAWBACK_DEFAULT_MAX_TOKENS": "8", "CLAWBACK_SERVED_MODEL_NAME": "clawback"})
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def auth(daemon: DaemonProcess) -> dict[str, str]:
    return {"authorization": f"Bearer {daemon.api_key}"}


@pytest.fixture(scope="module")
def doc(daemon: DaemonProcess, auth: dict[str, str]) -> dict:
    return httpx.get(f"{daemon.url}/openapi.json", headers=auth, timeout=60).json()


def test_every_route_is_fuzzed(doc: dict):
    described = {(path, method.upper()) for path, ops in doc["paths"].items() for method in ops}
    assert described == set(EXAMPLES)


@pytest.mark.parametrize("path,method", list(EXAMPLES), ids=[f"{m} {p}" for p, m in EXAMPLES])
def test_no_input_gives_a_server_error(daemon: DaemonProcess, auth, doc, path, method):
    operation = schemathesis.openapi.from_dict(doc)[path][method]
    seen: list[int] = []

    @settings(max_examples=EXAMPLES[(path, method)], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(), valid_messages=st.booleans())
    def run(case, valid_messages):
        if isinstance(case.body, dict) and path == "/v1/chat/completions":
            # Half the cases get a conversation the model can render, so that the fuzzed sampling,
            # tool and metadata fields reach generation and the store instead of failing early.
            case.body["model"] = "clawback"
            for field in ("max_tokens", "max_completion_tokens"):  # bound generation time
                value = case.body.setdefault(field, 4)
                if isinstance(value, int) and value > 4:
                    case.body[field] = 4
            if valid_messages:
                case.body["messages"] = [{"role": "user", "content": "Say something."}]
        response = case.call(base_url=daemon.url, headers=auth, timeout=120)
        seen.append(response.status_code)
        assert response.status_code < 500, f"{case.body!r} -> {response.status_code} {response.text[:500]}"

    run()
    if path in BODIES:
        assert any(400 <= s < 500 for s in seen), sorted(set(seen))
    if path in ("/v1/chat/completions", "/v1/feedback"):
        assert any(s < 300 for s in seen), sorted(set(seen))
    status = httpx.get(f"{daemon.url}/v1/status", headers=auth, timeout=60).json()
    assert status["generations_running"] == 0
    assert not any(op.endswith(":error") for op in status["store"]["dropped"]), status["store"]["dropped"]
