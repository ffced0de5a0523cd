"""Real end-to-end: the clawback daemon (embedded SmolLM2, slim OpenClaw profile) + openclaw@2026.9.6
gateway, set up the way a newcomer does it: `clawback openclaw install` (plugin linked, provider and
slim profile written), the gateway started, `clawback openclaw doctor --test-turn` all green. Then a
2-turn chat.send conversation, a reaction, /bad, /correct; the daemon is killed, /good is sent, the
daemon restarts: the event must arrive exactly once. Last, `clawback openclaw uninstall` must restore
openclaw.json byte for byte. Each step's time is printed.

Run by extension/scripts/ci.sh (which provides Node 24 and openclaw in ~/.cache/clawback). Needs:
  CLAWBACK_NODE24  path to a node >= 24.16 binary
  CLAWBACK_OPENCLAW_MJS  path to openclaw.mjs of openclaw@2026.9.6
Prints one `E2E ...` line per step; exits non-zero on the first failed assertion.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from websockets.sync.client import connect

from clawback.engines.supervisor import free_port

EXT = Path(__file__).resolve().parents[1]
REPO = EXT.parent
NODE = os.environ["CLAWBACK_NODE24"]
OC_MJS = os.environ["CLAWBACK_OPENCLAW_MJS"]
CACHE = Path(os.environ.get("CLAWBACK_TEST_CACHE", Path.home() / ".cache" / "clawback"))
T0 = time.time()
TIMES: dict[str, float] = {}  # step -> seconds, printed at the end


def log(msg: str) -> None:
    print(f"E2E [{time.time() - T0:6.1f}s] {msg}", flush=True)


def wait_for(pred, timeout: float, what: str, every: float = 0.25):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def q(db: Path, sql: str, *args) -> list[sqlite3.Row]:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        return conn.execute(sql, args).fetchall()
    finally:
        conn.close()


class Daemon:
    def __init__(self, data_dir: Path, model_dir: Path, port: int) -> None:
        self.data_dir, self.model_dir, self.port = data_dir, model_dir, port
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.log = data_dir / "daemon.log"

    def start(self) -> Daemon:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CLAWBACK_TRAIN__ENABLED": "false", "CLAWBACK_JUDGE__BACKEND": "off"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clawback.daemon.cli", "serve", "--model", str(self.model_dir),
             "--port", str(self.port), "--data-dir", str(self.data_dir)],
            stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=env, cwd=REPO)

        def up():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited:\n{self.log.read_text()[-4000:]}")
            try:
                return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, 180, "the daemon")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


class Gateway:
    """`openclaw gateway run` plus an operator WebSocket client (backend mode, shared token)."""

    def __init__(self, home: Path, port: int, token: str, env: dict[str, str]) -> None:
        self.home, self.port, self.token, self.env = home, port, token, env
        self.proc: subprocess.Popen | None = None
        self.log = home / "gateway.log"
        self.ws = None
        self.events: list[dict] = []
        self._n = 0

    def start(self) -> Gateway:
        self.proc = subprocess.Popen([NODE, OC_MJS, "gateway", "run", "--port", str(self.port), "--bind", "loopback"],
                                     stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

        def ready():
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited:\n{self.log.read_text()[-4000:]}")
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(ready, 180, "the gateway /readyz", every=0.5)
        self.ws = connect(f"ws://127.0.0.1:{self.port}", max_size=None, open_timeout=30)
        challenge = json.loads(self.ws.recv(timeout=30))
        assert challenge.get("event") == "connect.challenge", challenge
        self.request("connect", {
            "minProtocol": 4, "maxProtocol": 4,
            "client": {"id": "gateway-client", "version": "0.1.0", "platform": "linux", "mode": "backend"},
            "role": "operator", "scopes": ["operator.read", "operator.write", "operator.admin"],
            "caps": [], "commands": [], "permissions": {}, "auth": {"token": self.token}})
        return self

    def request(self, method: str, params: dict, timeout: float = 60) -> dict:
        self._n += 1
        rid = f"r{self._n}"
        self.ws.send(json.dumps({"type": "req", "id": rid, "method": method, "params": params}))
        deadline = time.time() + timeout
        while time.time() < deadline:
            frame = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.time())))
            if frame.get("type") == "res" and frame.get("id") == rid:
                if not frame.get("ok"):
                    raise AssertionError(f"{method} failed: {frame.get('error')}")
                return frame.get("payload") or {}
            if frame.get("type") == "event":
                self.events.append(frame)
        raise AssertionError(f"no answer to {method}")

    def pump(self, seconds: float) -> None:
        deadline = time.time() + seconds
        while time.time() < deadline:
            try:
                frame = json.loads(self.ws.recv(timeout=max(0.05, deadline - time.time())))
            except TimeoutError:
                return
            if frame.get("type") == "event":
                self.events.append(frame)

    def chat_final(self, run_id: str, timeout: float) -> dict:
        """Waits for the terminal chat event of a run (final / error / aborted)."""
        def done():
            for e in self.events:
                p = e.get("payload") or {}
                if e.get("event") == "chat" and p.get("runId") == run_id and p.get("state") in ("final", "error", "aborted"):
                    return p
            self.pump(0.5)
            return None
        return wait_for(done, timeout, f"chat run {run_id} to finish", every=0)

    def send(self, session_key: str, message: str, timeout: float = 240) -> tuple[str, dict]:
        run_id = f"e2e-{uuid.uuid4().hex[:12]}"
        res = self.request("chat.send", {"sessionKey": session_key, "message": message, "idempotencyKey": run_id})
        assert res.get("runId", run_id) == run_id, res
        return run_id, self.chat_final(run_id, timeout)

    def history_text(self, session_key: str) -> list[dict]:
        return self.request("chat.history", {"sessionKey": session_key, "limit": 20}).get("messages", [])

    def stop(self) -> None:
        if self.ws is not None:
            with contextlib.suppress(Exception):
                self.ws.close()
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None


def text_of(payload: dict) -> str:
    msg = payload.get("message") or {}
    content = msg.get("content") if isinstance(msg, dict) else msg
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(c.get("text", "") for c in content if isinstance(c, dict))
    return json.dumps(payload)[:400]


def main() -> int:
    sys.path.insert(0, str(REPO))
    from clawback.daemon.config import EMBEDDED_MODEL
    from clawback.daemon.models import CATALOGUE, pull

    model_dir = pull(CATALOGUE[EMBEDDED_MODEL], CACHE / "models")
    work = Path(tempfile.mkdtemp(prefix="clawback-oc-e2e-"))
    keep = os.environ.get("CLAWBACK_E2E_KEEP") == "1"
    log(f"work dir {work}")
    daemon = Daemon(work / "daemon", model_dir, free_port())
    gw = None
    ok = False
    try:
        daemon.start()
        key = (daemon.data_dir / "api_key").read_text().strip()
        models = httpx.get(f"{daemon.url}/v1/models", headers={"Authorization": f"Bearer {key}"}).json()["data"][0]
        log(f"daemon up on {daemon.url}: model {models['id']} context {models.get('context_length')}")

        home = work / "oc"
        (home / ".openclaw").mkdir(parents=True)
        gw_port, token = free_port(), "e2e-" + uuid.uuid4().hex
        env = {**os.environ, "OPENCLAW_HOME": str(home), "OPENCLAW_DISABLE_BONJOUR": "1",
               "PATH": f"{Path(NODE).parent}:{os.environ['PATH']}", "NO_COLOR": "1",
               "TMPDIR": str(work / "tmp")}  # OpenClaw writes its log file under the temp dir
        (work / "tmp").mkdir()
        env.pop("OPENCLAW_STATE_DIR", None)
        env.pop("OPENCLAW_CONFIG_PATH", None)
        base = {
            "gateway": {"mode": "local", "port": gw_port, "bind": "loopback", "auth": {"mode": "token", "token": token}},
            "update": {"checkOnStart": False},
            "logging": {"file": str(work / "openclaw.log")},  # not the shared /tmp/openclaw
            "agents": {"defaults": {"workspace": str(home / "workspace"), "heartbeat": {"every": "0m"},
                                    "compaction": {"memoryFlush": {"enabled": False}}}},
            "plugins": {"entries": {"memory-core": {"config": {"dreaming": {"enabled": False}}}}},
        }
        config_path = home / ".openclaw" / "openclaw.json"
        config_path.write_text(json.dumps(base, indent=2))
        original = config_path.read_bytes()
        clawback = [sys.executable, "-m", "clawback.cli", "openclaw", "--openclaw", f"{NODE} {OC_MJS}",
                    "--url", daemon.url, "--data-dir", str(daemon.data_dir)]

        def cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
            """Runs `clawback openclaw ...`; the operator socket keeps reading meanwhile (keepalive)."""
            t = time.time()
            out = (work / f"{args[0]}.log").open("w+")
            proc = subprocess.Popen([*clawback[:4], *args, *clawback[4:]], env=env, stdout=out,
                                    stderr=subprocess.STDOUT, text=True, cwd=REPO)
            while proc.poll() is None and time.time() - t < timeout:
                gw.pump(1.0) if gw else time.sleep(0.5)
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            TIMES[f"clawback openclaw {args[0]}"] = round(time.time() - t, 1)
            out.seek(0)
            text = out.read()
            out.close()
            return subprocess.CompletedProcess(proc.args, proc.returncode, text, "")

        # What a newcomer types: install --yes (links the plugin, adds the provider from /v1/models,
        # every default answer: clawback the default model, the slim profile); the gateway here is a
        # foreground `gateway run`, so it is started after install.
        inst = cli("install", "--max-tokens", "24", "--yes", "--no-restart", "--no-verify")
        assert inst.returncode == 0, f"clawback openclaw install failed:\n{inst.stdout}\n{inst.stderr}"
        assert "+ models.providers.clawback.baseUrl" in inst.stdout and key not in inst.stdout, inst.stdout
        assert "(--make-default)? yes (the default answer: --yes)" in inst.stdout, inst.stdout
        assert "(--slim)? yes (the default answer: --yes)" in inst.stdout, inst.stdout
        assert not [line for line in inst.stdout.splitlines() if line.strip() in ("-", "+", "~")], inst.stdout
        cfg = json.loads(config_path.read_text())
        assert cfg["models"]["providers"]["clawback"]["models"][0]["contextWindow"] == models["context_length"]
        assert cfg["agents"]["defaults"]["model"]["primary"] == f"clawback/{models['id']}"
        assert cfg["tools"]["deny"] == ["*"] and cfg["agents"]["defaults"]["skills"] == []
        assert cfg["plugins"]["entries"]["clawback"]["hooks"]["allowConversationAccess"] is True
        log(f"clawback openclaw install ok in {TIMES['clawback openclaw install']}s; it printed:\n"
            + "\n".join(l for l in inst.stdout.splitlines() if l.startswith("  ")))

        t = time.time()
        gw = Gateway(home, gw_port, token, env).start()
        TIMES["openclaw gateway run (until ready)"] = round(time.time() - t, 1)
        log("gateway ready, operator socket connected")

        doc = cli("doctor", "--test-turn")
        log(f"clawback openclaw doctor --test-turn in {TIMES['clawback openclaw doctor']}s:\n{doc.stdout}")
        assert doc.returncode == 0 and "all green" in doc.stdout, f"doctor:\n{doc.stdout}\n{doc.stderr}"
        checks = q(daemon.data_dir / "clawback.db", "SELECT call_id, turn_type, request_json FROM calls")
        before_chat = {r["call_id"] for r in checks}
        # The test turn's reply is capped at a few tokens by the plugin (not the model's 24 here,
        # nor a newcomer's 1,024).
        caps = [json.loads(r["request_json"]) for r in checks if r["turn_type"] == "main"]
        caps = [c.get("max_completion_tokens") or c.get("max_tokens") for c in caps]
        assert caps and all(c == 16 for c in caps), caps

        sk = "agent:main:e2e"
        turns = []
        for msg in ["Hi! What is 2 plus 2?", "Thanks. And 3 plus 3?"]:
            run_id, final = gw.send(sk, msg)
            assert final.get("state") == "final", f"turn {run_id} ended {final}"
            turns.append(run_id)
            log(f"turn {run_id}: {text_of(final)[:80]!r}")

        db = daemon.data_dir / "clawback.db"
        every_call = q(db, "SELECT call_id, session_id, turn_id, turn_type, request_id FROM calls ORDER BY created_at")
        calls = [c for c in every_call if c["call_id"] not in before_chat]  # not the doctor's test turn
        main = [c for c in calls if c["turn_type"] == "main"]
        side = [c for c in calls if c["turn_type"] != "main"]
        log(f"daemon saw {len(calls)} calls: {len(main)} main, {len(side)} side")
        assert {c["turn_id"] for c in main} == set(turns), [dict(c) for c in calls]
        for c in main:
            assert c["request_id"].startswith(f"{c['turn_id']}:model:"), dict(c)
        sessions = {c["session_id"] for c in main}
        assert len(sessions) == 1 and not next(iter(sessions)).startswith("anon-"), sessions
        session_id = next(iter(sessions))
        for c in side:
            assert c["turn_id"] not in turns or ":compaction:" in (c["request_id"] or ""), dict(c)
        last_call = [c for c in main if c["turn_id"] == turns[1]][-1]["call_id"]

        def fb(kind: str):
            return q(db, "SELECT event_id, kind, session_id, target, text, source, state, call_id FROM feedback_events WHERE kind = ?", kind)

        # A Telegram-format reaction as a session system event (how channels deliver them), polled by the plugin.
        gw.request("system-event", {"text": "Telegram reaction added: 👍 by Tester (@tester) on msg 42", "sessionKey": sk})
        up = wait_for(lambda: fb("thumbs_up"), 30, "the reaction to reach the daemon")
        assert len(up) == 1 and up[0]["source"] == "telegram" and up[0]["state"] == "applied", [dict(r) for r in up]
        assert up[0]["session_id"] == session_id and up[0]["call_id"] == last_call and up[0]["target"] == turns[1], dict(up[0])
        log("telegram-format reaction → thumbs_up applied to the last reply")

        run_id, final = gw.send(sk, "/bad", timeout=60)
        bad_reply = text_of(final)
        down = wait_for(lambda: fb("thumbs_down"), 30, "/bad to reach the daemon")
        assert len(down) == 1 and down[0]["state"] == "applied" and down[0]["call_id"] == last_call, [dict(r) for r in down]
        assert down[0]["session_id"] == session_id and down[0]["source"] == "webchat", dict(down[0])
        log(f"/bad → thumbs_down applied to {last_call}; reply {bad_reply[:90]!r}")

        run_id, final = gw.send(sk, "/correct use fewer words", timeout=60)
        fix = wait_for(lambda: fb("correction"), 30, "/correct to reach the daemon")
        assert len(fix) == 1 and fix[0]["text"] == "use fewer words" and fix[0]["call_id"] == last_call, [dict(r) for r in fix]
        log(f"/correct → correction applied; reply {text_of(final)[:90]!r}")

        n_calls = len(every_call)
        assert len(q(db, "SELECT call_id FROM calls")) == n_calls, "commands must not call the model"

        run_id, final = gw.send(sk, "/clawback", timeout=60)
        status = text_of(final)
        assert "adapter:" in status and "samples waiting" in status, status
        log(f"/clawback → {status.splitlines()[0]!r} …")

        # Daemon down: /good waits in the durable outbox, and arrives exactly once after the restart.
        daemon.kill()
        log("daemon killed (SIGKILL)")
        run_id, final = gw.send(sk, "/good", timeout=60)
        good_reply = text_of(final)
        assert "queued" in good_reply, good_reply
        outbox = home / ".openclaw" / "plugins" / "clawback" / "outbox.jsonl"
        pending = [json.loads(l) for l in outbox.read_text().splitlines() if l.strip()] if outbox.exists() else []
        candidates = list((home / ".openclaw").rglob("outbox.jsonl"))
        assert candidates, "no outbox file"
        outbox = candidates[0]
        pending = [json.loads(l) for l in outbox.read_text().splitlines() if l.strip()]
        assert [p["event"]["kind"] for p in pending if p.get("op") == "add"] == ["thumbs_up"], pending
        good_id = pending[0]["event"]["event_id"]
        log(f"/good while down → {good_reply[:70]!r}; outbox {outbox.relative_to(home)} holds it")
        time.sleep(3)  # a few reconnect attempts against a dead port
        daemon.start()
        log("daemon restarted")
        row = wait_for(lambda: q(db, "SELECT * FROM feedback_events WHERE event_id = ?", good_id), 60, "/good after the restart")
        assert row[0]["state"] == "applied" and row[0]["call_id"] == last_call, dict(row[0])
        wait_for(lambda: not [l for l in outbox.read_text().splitlines() if l.strip()], 20, "the outbox to empty")
        time.sleep(3)
        ups = fb("thumbs_up")
        assert len([r for r in ups if r["event_id"] == good_id]) == 1 and len(ups) == 2, [dict(r) for r in ups]
        total = q(db, "SELECT kind, COUNT(*) AS n FROM feedback_events GROUP BY kind ORDER BY kind")
        log("feedback rows: " + ", ".join(f"{r['kind']}={r['n']}" for r in total))
        assert {r["kind"]: r["n"] for r in total} == {"correction": 1, "thumbs_down": 1, "thumbs_up": 2}, [dict(r) for r in total]
        log(f"/good delivered exactly once after the restart (event {good_id})")

        # Session lifecycle: a reset fires before_reset / session_end → one session_end event.
        gw.request("sessions.reset", {"key": sk, "reason": "reset"})
        end = wait_for(lambda: fb("session_end"), 30, "session_end after sessions.reset")
        time.sleep(2)
        end = fb("session_end")
        assert len(end) == 1 and end[0]["session_id"] == session_id and end[0]["state"] == "applied", [dict(r) for r in end]
        log("sessions.reset → one session_end applied")

        gw.stop()
        gw = None
        un = cli("uninstall")
        assert un.returncode == 0, f"uninstall:\n{un.stdout}\n{un.stderr}"
        assert config_path.read_bytes() == original, "uninstall must restore openclaw.json byte for byte"
        leaks = [str(p.relative_to(home)) for p in home.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
        assert not leaks, f"the daemon's API key is still in OpenClaw's directory: {leaks}\n{un.stdout}"
        log(f"clawback openclaw uninstall in {TIMES['clawback openclaw uninstall']}s: openclaw.json restored byte for byte")
        log("step times (s): " + json.dumps(TIMES))
        ok = True
        log("PASS")
        return 0
    finally:
        if gw:
            gw.stop()
        daemon.stop()
        if not ok:
            for name in ("gateway.log",):
                p = work / "oc" / name
                if p.exists():
                    print(f"----- {name} (tail) -----\n" + p.read_text()[-6000:])
            p = daemon.log
            if p.exists():
                print("----- daemon.log (tail) -----\n" + p.read_text()[-3000:])
        if ok and not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
