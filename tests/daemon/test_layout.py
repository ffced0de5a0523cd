"""The [layout] table: its shape, what one machine allows, and the check against a cluster's nodes
(in the shape `ray.nodes()` returns them; the real cluster is in tests/e2e/test_layout.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from clawback.daemon.config import load_settings
from clawback.daemon.layout import Layout, PlacementError, RayPlacement, check_nodes

HEAD, GPU_BOX = "a" * 56, "b" * 56


def node(node_id: str, labels: dict | None = None, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"memory": 1e9, f"node:{node_id[:4]}": 1.0, **resources},
            "Labels": {"ray.io/node-id": node_id, **(labels or {})}}


NODES = [node(HEAD, CPU=4), node(GPU_BOX, {"clawback-role": "trainer"}, CPU=8, GPU=2, trainer_node=1)]


@pytest.fixture
def clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for key in list(os.environ):
        if key.upper().startswith("CLAWBACK_"):
            monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_defaults_are_one_machine(clean_env: Path) -> None:
    layout = load_settings(data_dir=str(clean_env / "data")).layout
    assert layout == Layout()
    assert layout.engine.bundle() == {} and layout.judge.bundle() == {}  # nothing reserved
    assert layout.trainer.bundle(layout.trainer_gpus("auto")) == {"CPU": 1.0}
    assert layout.trainer_gpus("cuda:1") == 1.0  # as before layouts: a GPU when it trains on cuda
    assert check_nodes(layout, [node(HEAD, CPU=2)], HEAD, "cpu") == []


def test_toml_layout_table(clean_env: Path) -> None:
    (clean_env / "clawback.toml").write_text(
        'ray_address = "10.0.0.1:6379"\n'
        "[layout.trainer]\nnum_gpus = 1\nresources = { trainer_node = 1 }\n"
        'node_labels = { "clawback-role" = "trainer" }\n'
        "[layout.engine]\nnum_gpus = 1\n")
    layout = load_settings(data_dir=str(clean_env / "data")).layout
    assert layout.trainer.bundle(layout.trainer_gpus("auto")) == {"CPU": 1.0, "GPU": 1.0, "trainer_node": 1.0}
    assert layout.trainer.node_labels == {"clawback-role": "trainer"}
    assert layout.engine.bundle() == {"GPU": 1.0} and layout.judge == Layout().judge


@pytest.mark.parametrize("table, error", [
    ({"trainer": {"resources": {"trainer_node": 1}}}, "need a Ray cluster"),  # no ray_address
    ({"engine": {"node_labels": {"zone": "a"}}}, "need a Ray cluster"),
])
def test_a_local_runtime_cannot_offer_custom_resources_or_labels(clean_env: Path, table: dict, error: str) -> None:
    s = load_settings(data_dir=str(clean_env / "data"), layout=table)  # other commands (status, adapters) still work
    with pytest.raises(PlacementError, match=error):  # `serve` refuses it before building anything
        RayPlacement(s.layout, s.ray_address, s.train.device)
    RayPlacement(s.layout, "10.0.0.1:6379", s.train.device)  # nothing connects before connect()


@pytest.mark.parametrize("table, error", [
    ({"trainer": {"num_gpus": -1}}, "greater than or equal"),
    ({"trainer": {"num_cpus": 0}}, "asks for no resources"),
    ({"trainer": {"resources": {"GPU": 1}}}, "use num_cpus / num_gpus"),
    ({"trainer": {"resources": {"trainer_node": 0}}}, "amount > 0"),
    ({"trainer": {"node_labels": {"zone": "!a"}}}, "matched exactly"),
    ({"trainer": {"node_labels": {"bad key!": "a"}}}, "label key"),
    ({"trainer": {"gpus": 1}}, "Extra inputs"),
    ({"scheduler": {}}, "Extra inputs"),
])
def test_bad_tables_are_refused_when_settings_load(clean_env: Path, table: dict, error: str) -> None:
    with pytest.raises(ValidationError, match=error):
        load_settings(data_dir=str(clean_env / "data"), ray_address="10.0.0.1:6379", layout=table)


def test_the_trainer_needs_some_node_that_has_its_resources_and_labels() -> None:
    fits = Layout(trainer={"num_gpus": 1, "resources": {"trainer_node": 1}, "node_labels": {"clawback-role": "trainer"}})
    assert check_nodes(fits, NODES, HEAD, "cuda") == []
    for wrong in ({"num_gpus": 4}, {"resources": {"tpu": 1}}, {"node_labels": {"clawback-role": "judge"}}):
        problems = check_nodes(Layout(trainer=wrong), NODES, HEAD, "cpu")
        assert len(problems) == 1 and "no node can host layout.trainer" in problems[0]
        assert GPU_BOX[:8] in problems[0]  # says what the nodes do have
    dead = [node(HEAD, CPU=4), node(GPU_BOX, {"clawback-role": "trainer"}, alive=False, CPU=8, trainer_node=1)]
    assert check_nodes(Layout(trainer={"resources": {"trainer_node": 1}}), dead, HEAD, "cpu")


def test_engine_and_judge_must_fit_the_daemons_own_node() -> None:
    # They run in the daemon's process: the GPU box has a GPU, but the daemon runs on HEAD.
    problems = check_nodes(Layout(engine={"num_gpus": 1}), NODES, HEAD, "cpu")
    assert len(problems) == 1 and "layout.engine runs in the daemon's process" in problems[0]
    assert check_nodes(Layout(engine={"num_gpus": 1}), NODES, GPU_BOX, "cpu") == []
    assert check_nodes(Layout(judge={"node_labels": {"clawback-role": "trainer"}}), NODES, GPU_BOX, "cpu") == []
    assert "layout.judge" in check_nodes(Layout(judge={"node_labels": {"zone": "x"}}), NODES, GPU_BOX, "cpu")[0]
    both = Layout(engine={"num_gpus": 1.5}, judge={"num_gpus": 1})  # each fits, together they do not
    assert "together" in check_nodes(both, NODES, GPU_BOX, "cpu")[0]
    assert "not an alive node" in check_nodes(Layout(), NODES, "c" * 56, "cpu")[0]



def test_on_one_gpu_the_engine_and_the_trainer_cannot_both_reserve_it() -> None:
    one_gpu = [node(HEAD, CPU=4, GPU=1)]
    assert check_nodes(Layout(engine={"num_gpus": 1}), one_gpu, HEAD, "cpu") == []
    assert check_nodes(Layout(), one_gpu, HEAD, "cuda") == []  # the default: only the trainer reserves it
    problems = check_nodes(Layout(engine={"num_gpus": 1}), one_gpu, HEAD, "cuda")
    assert len(problems) == 1 and "no node can host layout.trainer ({'CPU': 1.0, 'GPU': 1.0}" in problems[0]
    assert "'GPU': 0.0" in problems[0]  # what is left of the daemon's node


def test_the_readme_example_is_a_valid_layout(clean_env: Path) -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    example = readme.split("### Beyond one machine", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    (clean_env / "clawback.toml").write_text(example)
    s = load_settings(data_dir=str(clean_env / "data"))
    assert s.ray_address == "10.0.0.5:6379" and s.layout.reserve_timeout_s == 120
    assert s.layout.trainer.bundle(s.layout.trainer_gpus(s.train.device)) == {"CPU": 1, "GPU": 1, "trainer_node": 1}
    assert s.layout.engine.node_labels == {"ray.io/accelerator-type": "H100"} and s.layout.judge.bundle() == {"CPU": 1}
