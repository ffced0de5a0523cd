"""The gate's notes check (docs/gate.md, "5. The notes still followed") on the versions of a
simulated run: for each trained version, against the version it was trained from and against the
base model, the mean logprob, told, of the tokens the notes led the base model to on the person's
liked replies served with notes. Reads a copy of the run's store and loads its adapters; nothing
is generated.

    python bench/gate_notes.py --data OUT/.work/great/default_consolidated/seed2/data \
        --model ~/.clawback/models/qwen2.5-coder-0.5b-instruct
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sqlite3
import tempfile
from pathlib import Path


async def main(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoTokenizer

    from clawback.chat import ChatRenderer
    from clawback.daemon.config import GateConfig
    from clawback.daemon.gate import CandidateGate
    from clawback.daemon.store import Store
    from clawback.engines.embedded import EmbeddedEngine

    tmp = Path(tempfile.mkdtemp())
    src = sqlite3.connect(f"file:{args.data / 'clawback.db'}?mode=ro", uri=True)
    src.backup(dst := sqlite3.connect(tmp / "clawback.db"))  # a consistent copy of a running run's store
    dst.close()
    src.close()
    parents = dict(sqlite3.connect(tmp / "clawback.db").execute(
        "SELECT version, parent FROM adapters ORDER BY version").fetchall())
    store = Store(tmp / "clawback.db")
    engine = EmbeddedEngine(args.model, device="cpu", torch_threads=args.threads)
    tok = AutoTokenizer.from_pretrained(str(args.model))
    gate = CandidateGate(engine, ChatRenderer(tok), store, GateConfig())
    rows = []
    try:
        for call in gate._notes_calls():  # what the notes led the base model to, read behind the numbers
            led = await gate._led(call)
            print(json.dumps({"call": call.call_id, "reply": tok.decode(call.response_ids)[:80],
                              "led": [tok.decode([call.response_ids[i]]) for i in led]}), flush=True)
        for version, parent in parents.items():
            path = args.data / "adapters" / f"v{version}"
            if not path.is_dir():
                continue
            await engine.load_adapter(f"v{version}", str(path))
            for against in dict.fromkeys((parent, None)):
                check, reasons = await gate._notes(f"v{version}", None if against is None else f"v{against}")
                rows.append({"version": version, "against": against, "check": check and check.__dict__,
                             "refused": bool(reasons)})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        await engine.close()
        store.close()
        shutil.rmtree(tmp)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="a run's data directory (clawback.db, adapters/)")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    result = asyncio.run(main(a))
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
