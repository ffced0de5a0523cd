"""`install.sh --gpu` checks the NVIDIA driver before it installs anything.

This machine has no GPU, so the success path cannot run here. The failure paths run for real,
with PATH controlled: no nvidia-smi at all, and a stand-in `nvidia-smi` script (faked: there is
no driver to query) reporting a driver too old for SGLang's CUDA 13 torch, or no GPU.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_install(tmp_path: Path, nvidia_smi: str | None) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if nvidia_smi is not None:
        stub = bin_dir / "nvidia-smi"
        stub.write_text(f"#!/bin/sh\n{nvidia_smi}\n")
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "CLAWBACK_SGLANG_VENV": str(tmp_path / "sglang-venv")}
    return subprocess.run(["bash", str(REPO / "install.sh"), "--gpu"], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("stub,message", [
    (None, "no NVIDIA driver found (nvidia-smi is not on PATH)"),
    ('echo "535.104.05"', "NVIDIA driver 535.104.05 is too old"),
    ('echo "NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver." >&2; exit 9',
     "found no GPU or the driver is not loaded"),
])
def test_gpu_install_stops_with_a_clear_message_before_installing(tmp_path: Path, stub, message):
    r = run_install(tmp_path, stub)
    assert r.returncode == 1
    assert message in r.stderr
    assert "installing" not in r.stdout, "nothing was installed"
    assert not (tmp_path / "sglang-venv").exists()
