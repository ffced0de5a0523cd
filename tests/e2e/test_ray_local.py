"""The trainer's local Ray runtime serves this machine only: every listener of every Ray process
(and of the daemon's own process, which is a Ray driver) is on loopback, and the auth token file
is private. Runs `RayPlacement` in a fresh interpreter in the daemon's order: made at start, Ray
imported and connected at the first batch."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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
