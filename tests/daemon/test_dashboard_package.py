"""A non-editable install ships the dashboard: every template, script, style, vendored library and
license file is in the wheel (package data declared in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_ships_dashboard_assets(tmp_path: Path):
    src = tmp_path / "src"  # a copy: building in place would leave build/ in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in ("clawback", "daemon", "judge", "trainer", "sim"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    (wheel,) = tmp_path.glob("clawback-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"clawback/daemon/{p.relative_to(ROOT / 'daemon').as_posix()}"
              for folder in ("templates", "static") for p in (ROOT / "daemon" / folder).rglob("*") if p.is_file()}
    assert any(name.endswith("htmx.LICENSE") for name in wanted)  # the vendored libraries' licenses too
    assert wanted <= shipped, sorted(wanted - shipped)
