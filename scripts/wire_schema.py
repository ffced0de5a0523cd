"""Writes extension/schema/wire.schema.json from the daemon's wire models (clawback/daemon/wire.py).

    .venv/bin/python scripts/wire_schema.py && (cd extension && npm run wire-types)
"""

from __future__ import annotations

import json
from pathlib import Path

from clawback.daemon.wire import wire_schema

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "extension" / "schema" / "wire.schema.json"


def render() -> str:
    return json.dumps(wire_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render())
    print(f"wrote {SCHEMA_PATH}")
