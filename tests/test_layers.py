"""Imports go one way: core <- libraries (trainer, judge, engines) <- daemon <- sim <- cli.

Read from the source (every import, including those inside functions), so a tie hidden in a
function body fails here as surely as one at the top of a module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "clawback"

# What each layer must never import (prefix match on the dotted module name).
FORBIDDEN = {
    "core": ("clawback.daemon", "clawback.trainer", "clawback.judge", "clawback.sim", "clawback.cli"),
    "clawback.trainer": ("clawback.daemon", "clawback.judge", "clawback.sim", "clawback.cli"),
    "clawback.judge": ("clawback.daemon", "clawback.trainer", "clawback.sim", "clawback.cli"),
    "clawback.engines": ("clawback.daemon", "clawback.trainer", "clawback.judge", "clawback.sim", "clawback.cli"),
    "clawback.daemon": ("clawback.sim", "clawback.cli"),
    "clawback.sim": ("clawback.cli",),
}


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("clawback", *path.relative_to(PACKAGE).with_suffix("").parts))
        out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m.startswith("clawback")}


def layer(name: str) -> str:
    for prefix in sorted(FORBIDDEN, key=len, reverse=True):
        if name == prefix or name.startswith(prefix + "."):
            return prefix
    return "top" if name == "clawback.cli" else "core"


def test_one_way_imports():
    found = modules()
    assert {"clawback.chat", "clawback.engine", "clawback.adapter_format", "clawback.daemon.training",
            "clawback.daemon.samples", "clawback.trainer.worker", "clawback.judge.prm"} <= set(found)
    bad = []
    for name, path in sorted(found.items()):
        rule = FORBIDDEN.get(layer(name), ())
        for imported in sorted(imports(name, path)):
            if layer(imported) == layer(name):
                continue
            if any(imported == f or imported.startswith(f + ".") for f in rule):
                bad.append(f"{name} imports {imported}")
    assert not bad, "\n".join(bad)


def test_the_check_sees_function_local_and_relative_imports(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("def f():\n    from ..daemon import store\n    import clawback.sim.cli\n")
    assert imports("clawback.judge.x", path) >= {"clawback.daemon", "clawback.daemon.store", "clawback.sim.cli"}
    assert layer("clawback.judge.x") == "clawback.judge" and layer("clawback.chat") == "core"
    assert layer("clawback.engines.vllm") == "clawback.engines" and layer("clawback.cli") == "top"
