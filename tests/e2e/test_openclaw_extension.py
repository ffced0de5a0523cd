"""The OpenClaw extension's whole test layer in one go: vitest unit tests beside each source file,
a typecheck against openclaw@2026.9.6's own types, the publishable package built and validated by the
ClawHub CLI, and the real end-to-end of a newcomer's path (`clawback openclaw install`, the gateway,
`clawback openclaw doctor --test-turn` all green, tagged main calls, a reaction, /bad, /correct,
/clawback, /good surviving a killed daemon exactly once, `clawback openclaw uninstall` restoring
openclaw.json byte for byte). See extension/scripts/ci.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CI = REPO / "extension" / "scripts" / "ci.sh"


@pytest.mark.slow
def test_openclaw_extension_unit_and_end_to_end() -> None:
    assert shutil.which("npm"), "npm is needed to fetch Node 24, openclaw and the extension's dev dependencies"
    env = {**os.environ, "CLAWBACK_PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(CI)], cwd=REPO, env=env, capture_output=True, text=True, timeout=3000)
    out = proc.stdout + proc.stderr
    print(out[-20000:])
    assert proc.returncode == 0, f"extension/scripts/ci.sh failed (exit {proc.returncode}):\n{out[-12000:]}"
    assert "Tests" in out and "passed" in out, "vitest did not report"
    assert "E2E" in out and "PASS" in out, "the end-to-end did not run to the end"
