"""Where the engine, the judge and the trainer run: the `[layout]` table and its Ray placement.

    [layout.trainer]                       # the Ray actor that trains the LoRA
    num_cpus = 1
    num_gpus = 1                           # default: 1 if [train] device is cuda, else 0
    resources = { trainer_node = 1 }       # custom Ray resources a node must offer
    node_labels = { "clawback-role" = "trainer" }   # Ray node labels a node must carry

    [layout.engine]                        # same fields; default: nothing reserved
    num_gpus = 1

The trainer is a Ray actor placed through a placement group: one bundle of its resources, with its
node labels as the bundle's label selector. The engine and the judge run in the daemon's process
(the embedded engine; the judge is the same engine or an HTTP client), so for them the layout says
what the daemon's own node must be: its labels and resources are checked against that node at
start, and their amounts are reserved there (bundles pinned to the daemon's node) so that the
trainer, or anything else on the cluster, cannot be scheduled onto the engine's GPU.

Every field is checked: the table's shape when settings load; against the Ray cluster's nodes
before anything is reserved. `clawback serve` joins a cluster (`ray_address`) and checks at start;
the local Ray runtime (no `ray_address`) still starts with the first training batch, and since
only `num_cpus` and `num_gpus` make sense there, anything else is refused at start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from clawback.records import JsonObject

from . import reaper

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

log = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"  # Ray's default label: every node carries its own id
_BUILT_IN = {"CPU", "GPU", "memory", "object_store_memory"}
# Ray labels follow Kubernetes label syntax; values are matched exactly (no selector operators).
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}")
_LABEL_VALUE = re.compile(rf"({_LABEL_NAME})?")


class PlacementError(ValueError):
    """The layout cannot be placed: no cluster to join, or no node that fits (a ValueError, so the
    CLI prints it as one line)."""


class Placement(BaseModel):
    """Where one part runs: Ray resources it needs and node labels its node must carry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_cpus: float = Field(default=0, ge=0)
    num_gpus: float = Field(default=0, ge=0)
    resources: dict[str, float] = {}  # custom Ray resources, e.g. {"trainer_node": 1}
    node_labels: dict[str, str] = {}  # e.g. {"ray.io/accelerator-type": "H100", "clawback-role": "trainer"}

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            if name in _BUILT_IN:
                raise ValueError(f"{name!r} is not a custom resource: use num_cpus / num_gpus")
            if not name or amount <= 0:
                raise ValueError(f"resource {name!r}: needs a name and an amount > 0, got {amount}")
        return v

    @field_validator("node_labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            if not _LABEL_KEY.fullmatch(key):
                raise ValueError(f"node label key {key!r} is not a valid Ray (Kubernetes-style) label key")
            if not _LABEL_VALUE.fullmatch(value):
                raise ValueError(f"node label {key}={value!r}: values are matched exactly and must be "
                                 "alphanumerics, '-', '_' or '.' (at most 63)")
        return v

    def bundle(self, gpus: float | None = None) -> dict[str, float]:
        """The Ray resources of this part (`gpus` overrides num_gpus), without zeros (Ray refuses them)."""
        wanted = {"CPU": self.num_cpus, "GPU": self.num_gpus if gpus is None else gpus, **self.resources}
        return {k: float(v) for k, v in wanted.items() if v}

    def needs_cluster(self) -> bool:
        return bool(self.resources or self.node_labels)


class TrainerPlacement(Placement):
    num_cpus: float = Field(default=1, ge=0)
    num_gpus: float | None = Field(default=None, ge=0)  # type: ignore[assignment]  # None: 1 if [train] device is cuda, else 0

    @model_validator(mode="after")
    def _asks_for_something(self) -> TrainerPlacement:
        if not (self.num_cpus or self.num_gpus or self.resources):  # Ray rejects an empty bundle
            raise ValueError("layout.trainer asks for no resources: give it num_cpus, num_gpus or resources")
        return self


class Layout(BaseModel):
    """The `[layout]` table. The defaults are one machine: nothing reserved but the trainer's CPU
    (and a GPU when it trains on cuda)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    engine: Placement = Placement()
    judge: Placement = Placement()
    trainer: TrainerPlacement = TrainerPlacement()
    # How long to wait for the cluster to grant the reservation before giving up with an error.
    reserve_timeout_s: float = Field(default=120.0, gt=0)

    def check_local(self) -> None:
        """Raise unless a local Ray runtime (only this machine, no custom resources or labels) can host it."""
        wanting = [name for name in ("engine", "judge", "trainer") if getattr(self, name).needs_cluster()]
        if wanting:
            raise PlacementError(f"layout.{', layout.'.join(wanting)}: custom resources and node labels need a "
                                 "Ray cluster (ray_address / --ray-address); a local Ray runtime has neither")

    def trainer_gpus(self, trainer_device: str) -> float:
        if self.trainer.num_gpus is not None:
            return self.trainer.num_gpus
        return 1.0 if trainer_device.startswith("cuda") else 0.0


def check_nodes(layout: Layout, nodes: list[JsonObject], daemon_node: str, trainer_device: str) -> list[str]:
    """What in `layout` no node can satisfy; `nodes` as `ray.nodes()` returns them. Empty = fits.

    The engine and the judge must fit the daemon's own node (together); the trainer any alive node,
    the daemon's counting what is left after them. Whether the amounts are free right now (other
    Ray work) is the placement group's business, not this check's.
    """
    alive = [n for n in nodes if n.get("Alive")]
    problems = []
    home = next((n for n in alive if n["NodeID"] == daemon_node), None)
    if home is None:
        return [f"the daemon's own node {daemon_node} is not an alive node of the cluster"]
    together: dict[str, float] = {}
    for name in ("engine", "judge"):
        part: Placement = getattr(layout, name)
        missing = _unmet(part.bundle(), part.node_labels, home)
        if missing:
            problems.append(f"layout.{name} runs in the daemon's process, but this daemon's node "
                            f"({_describe(home)}) lacks {missing}: start the daemon on a node that has them")
        for k, v in part.bundle().items():
            together[k] = together.get(k, 0.0) + v
    if not problems and (missing := _unmet(together, {}, home)):
        problems.append(f"layout.engine and layout.judge together need more than the daemon's node has: {missing}")
    left = {**home, "Resources": {k: v - together.get(k, 0.0) for k, v in home.get("Resources", {}).items()}}
    candidates = [left if n is home else n for n in alive]
    trainer = layout.trainer.bundle(layout.trainer_gpus(trainer_device))
    if not any(not _unmet(trainer, layout.trainer.node_labels, n) for n in candidates):
        problems.append(f"no node can host layout.trainer ({trainer}, labels {layout.trainer.node_labels}); "
                        f"nodes, the daemon's less what engine and judge reserve: "
                        f"{'; '.join(_describe(n) for n in candidates)}")
    return problems


def _unmet(resources: dict[str, float], labels: dict[str, str], node: JsonObject) -> dict[str, float | str]:
    """What of `resources` and `labels` the node lacks: amounts, and the label values it lacks."""
    have, tags = node.get("Resources", {}), node.get("Labels", {})
    missing: dict[str, float | str] = {k: v for k, v in resources.items() if have.get(k, 0.0) < v}
    missing.update({f"label {k}": v for k, v in labels.items() if tags.get(k) != v})
    return missing


def _describe(node: JsonObject) -> str:
    resources = {k: v for k, v in node.get("Resources", {}).items()
                 if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
    labels = {k: v for k, v in node.get("Labels", {}).items() if k != NODE_ID_LABEL}
    return f"{node['NodeID'][:8]} {resources} {labels}"


def _local_runtime_env(token_path: Path) -> None:
    """A local Ray runtime serves this machine only: every listener on loopback, token auth with a
    private token file. Ray reads both from the environment (its processes inherit it) when it is
    imported, so this runs before the first `import ray`.

    Ray's own choice of node address is the machine's outward IP, and its servers then listen on
    all interfaces; with the cluster switch off it takes the loopback address and binds to it."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ["RAY_AUTH_MODE"] = "token"
    if not token_path.is_file():
        token_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            fd = os.open(token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(token_path)


def _no_api_server() -> None:
    """A local runtime starts without Ray's dashboard process: even with `include_dashboard=False`
    Ray starts it (as its state and job API server), and nothing here uses either."""
    from ray._private.node import Node

    Node.start_api_server = lambda self, **_: None  # type: ignore[method-assign]


class RayPlacement:
    """This daemon on Ray: joins the cluster (or starts a local runtime), checks the layout against
    its nodes, reserves the layout in one placement group, and starts the trainer actor in it."""

    def __init__(self, layout: Layout, ray_address: str | None, trainer_device: str,
                 token_path: Path | None = None) -> None:
        if ray_address is None:
            layout.check_local()
            if token_path is not None:  # this process will start the local runtime: before `import ray`
                _local_runtime_env(token_path)
        self.layout, self.ray_address, self.trainer_device = layout, ray_address, trainer_device
        self.trainer_gpus = layout.trainer_gpus(trainer_device)
        self.node_id: str | None = None  # the daemon's own Ray node
        self.group: PlacementGroup | None = None  # once reserved
        self.reaper: subprocess.Popen | None = None  # ends the local runtime with this process
        self.trainer_bundle = 0

    def connect(self) -> None:
        """Blocking and idempotent: the first call joins Ray, checks and reserves (PlacementError if it cannot)."""
        import ray
        from ray.util import placement_group, remove_placement_group

        if self.group is not None:
            return
        if self.ray_address and not ray.is_initialized():
            try:
                ray.init(address=self.ray_address, log_to_driver=False, ignore_reinit_error=True)
            except ConnectionError as e:
                raise PlacementError(f"cannot join the Ray cluster at {self.ray_address}: {e}") from e
        elif not ray.is_initialized():
            # Its files (logs, sockets, session data) inside a private dir (0700: Ray makes its
            # own temp dir 0777), not in /tmp/ray; the reaper deletes it and ends every Ray
            # process when the daemon ends.
            private = tempfile.mkdtemp(prefix="clawback-ray-")
            self.reaper = reaper.start(private)
            _no_api_server()
            # "local": never join a cluster some other program on this machine started
            ray.init(address="local", log_to_driver=False, ignore_reinit_error=True,
                     num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                     object_store_memory=256 * 1024 * 1024, _temp_dir=str(Path(private) / "ray"))
        self.node_id = ray.get_runtime_context().get_node_id()
        problems = check_nodes(self.layout, ray.nodes(), self.node_id, self.trainer_device)
        if problems:
            raise PlacementError("layout does not fit the Ray cluster: " + " | ".join(problems))
        bundles, selectors = [], []
        for name in ("engine", "judge"):  # pinned to the daemon's node, where they really run
            part: Placement = getattr(self.layout, name)
            if bundle := part.bundle():
                bundles.append(bundle)
                selectors.append({NODE_ID_LABEL: self.node_id})
        self.trainer_bundle = len(bundles)
        bundles.append(self.layout.trainer.bundle(self.trainer_gpus))
        selectors.append(dict(self.layout.trainer.node_labels))
        group = placement_group(bundles, strategy="PACK", bundle_label_selector=selectors)
        if not group.wait(timeout_seconds=self.layout.reserve_timeout_s):
            remove_placement_group(group)
            raise PlacementError(f"the Ray cluster did not grant the layout's reservation {bundles} within "
                                 f"{self.layout.reserve_timeout_s:.0f} s: the resources exist but are taken")
        self.group = group
        log.info("layout reserved on Ray: %s (daemon node %s)", bundles, self.node_id)

    def trainer_options(self) -> TrainerOptions:
        """`ray.remote(...).options(...)` for the trainer actor: its resources, inside its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert self.group is not None, "connect() reserves the group first"
        trainer = self.layout.trainer
        return {"num_cpus": trainer.num_cpus, "num_gpus": self.trainer_gpus, "resources": dict(trainer.resources),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(self.group, self.trainer_bundle)}


class TrainerOptions(TypedDict):
    """The trainer actor's `ray.remote(...).options(...)` (RayPlacement.trainer_options)."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]
    scheduling_strategy: PlacementGroupSchedulingStrategy
