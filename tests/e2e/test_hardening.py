"""A real daemon against stalled and oversized clients, crashes right after a reply, and secrets
in URLs: sockets are cut, bodies are refused without being read whole, a served main call is
committed before its reply completes, files are private and query strings stay out of the log."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from websockets.sync.client import connect

from tests.conftest import DaemonProcess, query


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    d = DaemonProcess(tmp_path_factory.mktemp("hard-data"), tiny_model_dir, "--no-auth",
                      env={"CLAWBACK_TRAIN__ENABLED": "false", "CLAWBACK_CLIENT_TIMEOUT_S": "2"})
    d.data_dir.chmod(0o755)  # as an older version left it
    d.start()
    yield d
    d.stop()


def raw(d: DaemonProcess, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", d.port), timeout=60)
    s.sendall(data)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_a_stalled_request_head_is_cut_off(daemon: DaemonProcess):
    s = raw(daemon, b"POST /v1/feedback HTTP/1.1\r\nHost: x\r\n")  # and never the rest
    t0 = time.monotonic()
    assert read_all(s) == b"" and time.monotonic() - t0 < 50  # closed by the server, not by our timeout
    s.close()


def test_a_stalled_body_gets_408(daemon: DaemonProcess):
    s = raw(daemon, b"POST /v1/feedback HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n{\"event_id\":")
    assert read_all(s).startswith(b"HTTP/1.1 408")
    s.close()


def test_an_oversized_feedback_body_is_refused_before_it_ends(daemon: DaemonProcess):
    """The 413 comes while the client is still sending (a chunked body with no length): the
    daemon does not read a body past 64 KB."""
    s = raw(daemon, b"POST /v1/feedback HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 16384
    for _ in range(6):  # 96 KB, and no terminating chunk: the body never ends
        s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    assert read_all(s).startswith(b"HTTP/1.1 413")
    s.close()


def test_a_main_call_is_committed_before_its_reply_completes(tiny_model_dir: Path, tmp_path: Path):
    """kill -9 right after each 200: every call whose reply completed is in the store."""
    d = DaemonProcess(tmp_path / "data", tiny_model_dir, "--no-auth", env={"CLAWBACK_TRAIN__ENABLED": "false"}).start()
    ids = []
    with httpx.Client(base_url=d.url, timeout=120) as c:
        for i in range(6):
            r = c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 3, "stream": i % 2 == 1,
                                                     "messages": [{"role": "user", "content": f"hi {i}"}]},
                       headers={"x-session-id": f"crash-{i}", "x-turn-type": "main"})
            assert r.status_code == 200
            ids.append(r.headers["x-clawback-call-id"])
    d.proc.kill()
    d.proc.wait()
    stored = {r[0] for r in query(d.data_dir / "clawback.db", "SELECT call_id FROM calls")}
    assert set(ids) <= stored


def test_files_are_private_and_query_strings_stay_out_of_the_log(daemon: DaemonProcess):
    with connect(daemon.url.replace("http", "ws") + "/v1/feedback/ws?api_key=cb-LEAKED-KEY-1") as sock:
        sock.recv(timeout=10)  # hello
    httpx.get(f"{daemon.url}/v1/models?api_key=cb-LEAKED-KEY-2", timeout=60)
    time.sleep(0.5)
    log = daemon.log.read_text()
    assert "WebSocket /v1/feedback/ws" in log and "LEAKED" not in log
    db = daemon.data_dir / "clawback.db"
    for f in db.parent.glob(db.name + "*"):
        assert f.stat().st_mode & 0o077 == 0, f
    # The data dir (0755 before the start) and all the daemon wrote in it.
    written = [daemon.data_dir, *(p for p in daemon.data_dir.rglob("*") if p != daemon.log)]
    assert len(written) > 3
    assert {str(p): oct(p.stat().st_mode & 0o777) for p in written if p.stat().st_mode & 0o077} == {}


def test_init_makes_the_data_dir_private(tiny_model_dir: Path, tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir(mode=0o755)  # as an older version left it
    subprocess.run([sys.executable, "-m", "clawback.daemon.cli", "init", "--data-dir", str(data), "--model",
                    str(tiny_model_dir)], check=True, capture_output=True, timeout=300)
    assert data.stat().st_mode & 0o777 == 0o700
    assert (data / "api_key").stat().st_mode & 0o777 == 0o600
