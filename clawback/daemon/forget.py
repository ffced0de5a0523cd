"""Forgetting: delete what the daemon stored about conversations, on request or by age.

One function serves `clawback forget`, `POST /v1/forget` and the `retain_days` sweep. The store
deletes the sessions' calls, next states, feedback, judge votes, samples and the memory notes
learnt from them (every note when it forgets everything), takes what those sessions asked for out
of the other sessions' calls that were served with it as a note (`scrubbed`: their requests and
rendered prompts are rewritten without it, their prompt tokens emptied, and their samples not yet
trained dropped as `forgotten_note`), and rewrites its files so that none of the text remains in
them (free pages and the WAL included); the append-only event log keeps a tombstone with counts
only. Adapter versions already trained on forgotten samples, or on a call served with a forgotten
note, still carry what they learnt from them: they are listed, with the rollback that removes them.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from datetime import datetime

from clawback.records import JsonObject

from .adapters import tainted_versions
from .capture import Capture
from .store import ForgetScope, Store


def parse_time(value: str | float) -> float:
    """Unix seconds, or an ISO 8601 date/time (local time when it has no zone)."""
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return float(value)
    except ValueError:
        return datetime.fromisoformat(value).timestamp()


async def forget(store: Store, scope: ForgetScope, capture: Capture | None = None) -> JsonObject:
    """Forget `scope`; returns what was deleted and the adapter versions trained on any of it,
    with `rollback_to`, the newest version trained before them (None: the base model): the reply
    of `POST /v1/forget`, the same JSON the CLI reads back from it."""
    result = await store.forget(scope)
    if capture is not None:
        capture.forget(None if scope.everything else result.sessions)
    rows = await asyncio.to_thread(store.adapters)
    return {"scope": scope.kind, "sessions": len(result.sessions), "deleted": result.deleted,
            "scrubbed": result.scrubbed, **asdict(tainted_versions(rows, result.trained_versions))}
