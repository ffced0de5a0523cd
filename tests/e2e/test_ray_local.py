"""The trainer's local Ray runtime serves this machine only: every listener of every Ray process
(and of the daemon's own process, which is a Ray driver) is on loopback, and the auth token file
is private. Runs `RayPlacement` in a fresh interpreter in the daemon's order: made at start, Ray
imported and connected at the first batch."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import scaled, wait_for

pytestmark = pytest.mark.slow  # starts a Ray runtime

PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import psutil
    from clawback.daemon.layout import Layout, RayPlacement
    placement = RayPlacement(Layout(), None, "cpu", token_path=Path(sys.argv[1]))
    import ray  # as the daemon's trainer starter does, before connecting
    placement.connect()
    ray.get(ray.remote(lambda: 1).remote())  # a worker process too
    session = ray._private.worker._global_node.get_session_dir_path().rsplit("/", 1)[-1]
    procs = [psutil.Process()] + [p for p in psutil.process_iter(["cmdline"]) if session in " ".join(p.info["cmdline"] or [])]
    found = []
    for p in procs:
        for c in p.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN:
                found.append([p.name(), c.laddr.ip, c.laddr.port])
    ray.shutdown()
    print(json.dumps(found))
""")


def test_local_ray_listens_on_loopback_only_with_a_private_token(tmp_path: Path):
    token = tmp_path / "data" / "ray_auth_token"
    out = subprocess.run([sys.executable, "-c", PROBE, str(token)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    listeners = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(listeners) >= 4, listeners  # the GCS, the raylet, the driver, a worker at least
    exposed = [x for x in listeners if x[1] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert not exposed, f"listening beyond loopback: {exposed}"
    assert token.stat().st_mode & 0o077 == 0 and len(token.read_text()) == 64


ENDS = textwrap.dedent("""
    import json, signal, sys, time
    from pathlib import Path
    from clawback.daemon.layout import Layout, RayPlacement
    placement = RayPlacement(Layout(), None, "cpu", token_path=Path(sys.argv[1]))
    import ray
    placement.connect()
    ray.get(ray.remote(lambda: 1).remote())  # a worker process too
    def stop(*_):  # what the daemon's shutdown does on SIGTERM
        ray.shutdown()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    print(json.dumps({"temp_dir": ray._private.worker._global_node.get_temp_dir_path()}), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_every_ray_process_ends_with_the_daemon_and_its_files_are_private(tmp_path: Path, sig: int):
    """The local runtime as the daemon starts it (`RayPlacement.connect` in a fresh interpreter,
    which on SIGTERM shuts Ray down as the daemon's shutdown does): no Ray dashboard, its files in
    a private dir, and when the process is stopped or killed every process it started ends,
    Ray's agents too, and the dir goes."""
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", ENDS, str(tmp_path / "token")], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line, "the probe did not start Ray"
        temp_dir = Path(json.loads(line)["temp_dir"])
        started = psutil.Process(proc.pid).children(recursive=True)
        cmdlines = []
        for p in started:  # a short-lived helper may have exited (a zombie until reaped) meanwhile
            with contextlib.suppress(psutil.NoSuchProcess):  # ZombieProcess is one
                cmdlines.append(" ".join(p.cmdline()))
        assert any("DashboardAgent" in c for c in cmdlines) and any("RuntimeEnvAgent" in c for c in cmdlines), cmdlines
        assert not any("dashboard/dashboard.py" in c for c in cmdlines), "Ray's dashboard is running"
        private = temp_dir.parent  # Ray makes its own temp dir 0777: what keeps others out is this one
        assert private.stat().st_mode & 0o077 == 0 and not str(temp_dir).startswith("/tmp/ray/")
        proc.send_signal(sig)
        proc.wait(timeout=scaled(60))
        wait_for(lambda: not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE],
                 timeout=30, what="every process the daemon started ended")
        wait_for(lambda: not private.exists(), timeout=30, what="Ray's temp dir deleted")
    finally:
        if proc.poll() is None:
            proc.kill()
