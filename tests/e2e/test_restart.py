"""Stop and start the real daemon on the same data dir: the store and session pairing continue."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from clawback.daemon.store import migrations
from tests.conftest import DaemonProcess, query, scaled


def post(d: DaemonProcess, messages: list[dict], session: str, **headers: str) -> dict:
    r = httpx.post(f"{d.url}/v1/chat/completions", timeout=scaled(60),
                   json={"model": "clawback", "messages": messages, "max_tokens": 6, "temperature": 0},
                   headers={"authorization": f"Bearer {d.api_key}", "x-session-id": session, "x-turn-type": "main", **headers})
    assert r.status_code == 200, r.text
    return r.json()


def rows(db: Path, sql: str) -> list[tuple]:
    return [tuple(r) for r in query(db, sql)]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clawback.daemon.cli", *args], capture_output=True, text=True)


def test_restart_keeps_store_and_pairing(tiny_model_dir: Path, tmp_path: Path):
    data = tmp_path / "data"
    first = DaemonProcess(data, tiny_model_dir).start()
    key = first.api_key
    messages = [{"role": "user", "content": "Remember the number 7."}]
    reply = post(first, messages, "keep-1")
    status = json.loads(cli("status", "--json", "--data-dir", str(data), "--port", str(first.port)).stdout)
    assert status["daemon"] == "running" and status["store"]["schema_version"] == len(migrations())
    summary = cli("status", "--data-dir", str(data), "--port", str(first.port)).stdout  # for people
    assert f"daemon: running at http://127.0.0.1:{first.port}" in summary, summary
    assert "main calls: 1 (0 paired with a next state, 1 waiting for one)" in summary, summary
    first.stop()  # SIGTERM: the writer drains before exit

    assert rows(data / "clawback.db", "SELECT state FROM calls") == [("awaiting_next_state",)]
    offline = cli("status", "--json", "--data-dir", str(data), "--port", str(first.port))
    assert offline.returncode == 0 and "not reachable" in json.loads(offline.stdout)["daemon"]
    summary = cli("status", "--data-dir", str(data), "--port", str(first.port)).stdout
    assert summary.startswith("daemon: not reachable") and "main calls: 1 (" in summary, summary

    second = DaemonProcess(data, tiny_model_dir).start()
    try:
        assert second.api_key == key, "the key survives a restart"
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Which number was it?"}]
        post(second, messages, "keep-1", **{"x-session-done": "1"})
    finally:
        second.stop()

    db = data / "clawback.db"
    assert rows(db, "SELECT state FROM calls ORDER BY created_at") == [("paired",), ("closed_without_next_state",)]
    (next_state,) = rows(db, "SELECT messages_json, reply_matched FROM next_states")
    assert json.loads(next_state[0]) == [{"role": "user", "content": "Which number was it?"}]
    assert next_state[1] == 1
    kinds = [k for (k,) in rows(db, "SELECT kind FROM events ORDER BY id")]
    assert kinds.count("schema.migrated") == len(migrations()), "migrations ran once, not again on restart"
    lifecycle = [k for k in kinds if k.startswith(("call.", "session."))]
    assert lifecycle == ["call.awaiting_next_state", "call.paired", "call.awaiting_next_state",
                         "call.closed_without_next_state", "session.closed"]


def published_versions(model_dir: Path, data: Path, versions: int) -> None:
    """Trained-looking versions v1..vN in a data dir, recorded as committed (no training run)."""
    import asyncio
    import time

    import torch
    from transformers import AutoModelForCausalLM

    from clawback.adapter_format import publish
    from clawback.daemon.store import Store
    from clawback.records import StepRecord
    from clawback.trainer.config import TrainConfig
    from clawback.trainer.step import make_lora_model, make_optimizer

    store = Store(data / "clawback.db")
    cfg = TrainConfig(lora_rank=4, lora_alpha=8)
    for v in range(1, versions + 1):
        model = make_lora_model(AutoModelForCausalLM.from_pretrained(str(model_dir)), cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.1)
        path = publish(data / "adapters", v, model, make_optimizer(model, cfg), {"method": "binary"})
        asyncio.run(store.record_step(StepRecord(version=v, parent=v - 1 or None, started_at=time.time(),
                                                 method="binary", call_ids=(), outcome="committed", path=str(path))))
    store.close()


def live_version(d: DaemonProcess) -> str | None:
    return httpx.get(f"{d.url}/v1/models", timeout=60).json()["data"][0]["adapter_version"]


def test_rollback_to_base_survives_graceful_restart_and_kill(tiny_model_dir: Path, tmp_path: Path):
    """`clawback adapters rollback base` was undone by a restart: the newest version went live again."""
    data = tmp_path / "data"
    data.mkdir()
    published_versions(tiny_model_dir, data, 2)
    flags = ("--no-auth",)
    env = {"CLAWBACK_TRAIN__ENABLED": "false"}
    d = DaemonProcess(data, tiny_model_dir, *flags, env=env).start()
    assert live_version(d) == "v2"
    out = cli("adapters", "rollback", "base", "--data-dir", str(data), "--port", str(d.port), "--no-auth")
    assert out.returncode == 0, out.stderr
    assert live_version(d) is None
    d.proc.kill()  # kill -9 right after the rollback was acknowledged
    d.proc.wait()
    d = DaemonProcess(data, tiny_model_dir, *flags, env=env).start()
    try:
        assert live_version(d) is None
    finally:
        d.stop()
    d = DaemonProcess(data, tiny_model_dir, *flags, env=env).start()  # and after a graceful stop
    try:
        assert live_version(d) is None
    finally:
        d.stop()
