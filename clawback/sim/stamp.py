"""What code a cell ran: a hash of clawback's own source, and the git commit when there is one.

The stamp hashes every .py and .sql file of the installed clawback package (not the git tree), so
committing results or docs leaves it unchanged while any change to the code, committed or not,
gives a new one. Summaries never mix cells of different stamps (results.py).
"""

from __future__ import annotations

import hashlib
import importlib
import subprocess
from functools import lru_cache
from pathlib import Path

from .cell_file import CodeStamp


@lru_cache(maxsize=1)
def code_stamp() -> CodeStamp:
    digest = hashlib.sha256()
    root = Path(importlib.import_module("clawback").__file__ or "").parent
    files = [f for f in sorted(root.rglob("*")) if f.suffix in (".py", ".sql") and "__pycache__" not in f.parts]
    for f in files:
        digest.update(f"clawback/{f.relative_to(root).as_posix()}\0".encode())
        digest.update(f.read_bytes())
    return {"stamp": digest.hexdigest()[:12], "commit": _git(root, "rev-parse", "HEAD"),
            "dirty": bool(_git(root, "status", "--porcelain", "--", ":(top)clawback"))}


def _git(where: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None
