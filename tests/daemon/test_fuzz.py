"""Property-based run over the daemon's OpenAPI schema (schemathesis, on hypothesis): requests
generated from the request models, valid and invalid, against a real daemon process (tiny random
Llama). No input may give a 5xx; the run is bounded by example counts (well under a minute)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import DaemonProcess

EXAMPLES = {("/v1/chat/completions", "POST"): 60, ("/v1/feedback", "POST"): 80,
            ("/v1/adapters/rollback", "POST"): 20, ("/v1/adapters/pin", "POST"): 20, ("/v1/forget", "POST"): 30}


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess(tmp_path_factory.mktemp("fuzz-data"), tiny_model_dir, env={
        "CLAWBACK_TRAIN": "false", "CLAWBACK_DEFAULT_MAX_TOKENS": "8", "CLAWBACK_SERVED_MODEL_NAME": "clawback"})
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def auth(daemon: DaemonProcess) -> dict[str, str]:
    return {"authorization": f"Bearer {daemon.api_key}"}


@pytest.fixture(scope="module")
def schema(daemon: DaemonProcess, auth: dict[str, str]):
    doc = httpx.get(f"{daemon.url}/openapi.json", headers=auth, timeout=60).json()
    return schemathesis.openapi.from_dict(doc)


@pytest.mark.parametrize("path,method", list(EXAMPLES), ids=[f"{m} {p}" for p, m in EXAMPLES])
def test_no_input_gives_a_server_error(daemon: DaemonProcess, auth, schema, path, method):
    operation = schema[path][method]
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
    assert any(400 <= s < 500 for s in seen), sorted(set(seen))
    if path in ("/v1/chat/completions", "/v1/feedback"):
        assert any(s < 300 for s in seen), sorted(set(seen))
    status = httpx.get(f"{daemon.url}/v1/status", headers=auth, timeout=60).json()
    assert status["generations_running"] == 0
    assert not any(op.endswith(":error") for op in status["store"]["dropped"]), status["store"]["dropped"]
