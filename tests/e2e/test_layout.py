"""The layout on a real two-node Ray cluster: the trainer goes to the node the layout names, its
adapters come back to the daemon through Ray's object store (no shared directory), go live and
serve; a layout the cluster cannot host stops the daemon at start.

Both Ray nodes run on this machine as separate `ray start` processes with separate temp dirs, a
private RAY_TMPDIR (so no other program's `ray.init()` finds this cluster) and a private auth token.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import DaemonProcess, free_port, scaled, wait_for
from tests.e2e.test_training import TRAIN_ENV, cli, rate

TRAINER_LABEL = {"clawback-role": "trainer"}

NODES_SCRIPT = """
import json, sys, time, ray
ray.init(address=sys.argv[1], log_to_driver=False)
while len([n for n in ray.nodes() if n["Alive"]]) < int(sys.argv[2]):
    time.sleep(0.2)
print(json.dumps([{"id": n["NodeID"], "labels": n["Labels"], "resources": n["Resources"]}
                  for n in ray.nodes() if n["Alive"]]))
"""


class RayCluster:
    """A head node (1 CPU) and a trainer node (1 CPU, resource `trainer_node`, label clawback-role=trainer)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="cb-ray-"))  # short: Ray's socket paths live under it
        self.address = f"127.0.0.1:{free_port()}"
        self.env = {"RAY_TMPDIR": str(self.root), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        self.procs: list[subprocess.Popen] = []

    def start(self) -> RayCluster:
        self._node("head", "--head", f"--port={self.address.split(':')[1]}", "--include-dashboard=false")
        self.nodes(1)
        self._node("trainer", f"--address={self.address}", '--resources={"trainer_node": 1}',
                   "--labels=" + ",".join(f"{k}={v}" for k, v in TRAINER_LABEL.items()))
        self.nodes(2)
        return self

    def _node(self, name: str, *args: str) -> None:
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
               "--num-cpus=1", "--object-store-memory=100000000", f"--temp-dir={self.root / name}", *args]
        log = (self.root / f"{name}.log").open("ab")
        # Its own session: teardown signals exactly this node's process group.
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                           env={**os.environ, **self.env}))

    def nodes(self, at_least: int = 2) -> list[dict]:
        """The alive nodes once there are `at_least` of them (asked as a Ray driver would)."""
        out = subprocess.run([sys.executable, "-c", NODES_SCRIPT, self.address, str(at_least)], capture_output=True,
                             text=True, timeout=300, env={**os.environ, **self.env})
        assert out.returncode == 0, out.stderr[-3000:] + self.logs()
        return json.loads(out.stdout.strip().splitlines()[-1])

    def logs(self) -> str:
        return "".join(f"\n--- {p.name}\n{p.read_text()[-2000:]}" for p in self.root.glob("*.log"))

    def stop(self) -> None:
        for p in self.procs:
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
            _signal_group(p, signal.SIGKILL)  # GCS and raylet that did not drain in time; workers follow their raylet
            p.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, sig)


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = RayCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def layout_toml(data_dir: Path, trainer: str, extra: str = "") -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "clawback.toml").write_text(f"[layout.trainer]\n{trainer}\n{extra}")


def test_trainer_trains_on_the_labelled_node_and_its_versions_reach_the_daemon_through_ray(
        ray_cluster: RayCluster, tiny_model_dir: Path, tmp_path: Path):
    nodes = ray_cluster.nodes()
    trainer_node = next(n["id"] for n in nodes if n["resources"].get("trainer_node"))
    head = next(n["id"] for n in nodes if n["id"] != trainer_node)
    data = tmp_path / "data"
    # The engine's CPU is reserved on the daemon's node (the head); the trainer needs both the
    # custom resource and the label, which only the trainer node has.
    layout_toml(data, 'num_cpus = 1\nresources = { trainer_node = 1 }\nnode_labels = { "clawback-role" = "trainer" }',
                "[layout.engine]\nnum_cpus = 1\n")
    d = DaemonProcess(data, tiny_model_dir, "--no-auth", "--ray-address", ray_cluster.address,
                      env={**TRAIN_ENV, **ray_cluster.env}).start()
    try:
        with httpx.Client(base_url=d.url, timeout=scaled(120)) as c:
            for k in (1, 2):  # batches of one: v1, then v2
                rate(c, f"remote-{k}")
                wait_for(lambda: c.get("/v1/adapters").json()["live"] == k, timeout=300, what=f"v{k} live")
            served = c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 3,
                                                          "messages": [{"role": "user", "content": "which version?"}]})
            assert served.json()["system_fingerprint"] == "v2"
            assert c.get("/v1/status").json()["training"]["trainer_node"] == trainer_node != head

            # Roll back to v1, which the actor no longer holds (it keeps only where it stands):
            # the daemon sends v1's files, and v3 is trained from v1.
            cli(d, "rollback", "1")
            rate(c, "remote-3")
            wait_for(lambda: c.get("/v1/adapters").json()["live"] == 3, timeout=300, what="v3 live")
            assert c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 3, "messages": [
                {"role": "user", "content": "and now?"}]}).json()["system_fingerprint"] == "v3"
    finally:
        d.stop()
    for v, parent in ((1, None), (2, 1), (3, 1)):
        meta = json.loads((data / "adapters" / f"v{v}" / "clawback.json").read_text())
        assert (meta["trainer_node"], meta["parent"]) == (trainer_node, parent)
    assert "Traceback" not in d.log.read_text()


def test_a_layout_no_node_can_host_stops_the_daemon_at_start(ray_cluster: RayCluster, tiny_model_dir: Path,
                                                             tmp_path: Path):
    data = tmp_path / "data"
    layout_toml(data, "resources = { tpu = 1 }")
    with pytest.raises(RuntimeError, match="daemon exited early") as failed:
        DaemonProcess(data, tiny_model_dir, "--no-auth", "--ray-address", ray_cluster.address,
                      env={**TRAIN_ENV, **ray_cluster.env}).start()
    assert "clawback: layout does not fit the Ray cluster: no node can host layout.trainer" in str(failed.value)
    assert "trainer_node" in str(failed.value)  # it lists what the nodes do offer
    assert sorted(p.name for p in data.iterdir() if p.suffix != ".log") == ["clawback.toml"]  # nothing built
