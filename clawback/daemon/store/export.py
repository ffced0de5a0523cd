"""Export: sessions, calls (with token ids and logprobs) and next states as JSON lines."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from .schema import blob_ids, blob_logprobs, blob_rows, connect


def export_jsonl(db_path: Path, out: TextIO, since: float | None = None) -> int:
    """Write sessions, calls (with token ids and logprobs) and next states as JSON lines."""
    conn = connect(db_path, readonly=True)
    n = 0
    try:
        for line in _export_rows(conn, since or 0.0):
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            n += 1
    finally:
        conn.close()
    return n


def _export_rows(conn: sqlite3.Connection, since: float) -> Iterator[dict[str, object]]:
    for r in conn.execute("SELECT * FROM sessions WHERE last_seen_at >= ? ORDER BY created_at", (since,)):
        yield {"type": "session", **dict(r)}
    for r in conn.execute("SELECT * FROM calls WHERE created_at >= ? ORDER BY created_at", (since,)):
        row = dict(r)
        row["request"] = json.loads(row.pop("request_json"))
        row["tool_calls"] = json.loads(row.pop("tool_calls_json") or "null")
        row["timings"] = json.loads(row.pop("timings_json"))
        row["prompt_ids"] = blob_ids(row["prompt_ids"])
        row["response_ids"] = blob_ids(row["response_ids"])
        row["behaviour_logprobs"] = blob_logprobs(row["behaviour_logprobs"])
        n = len(row["response_ids"])
        row["sampling_logprobs"] = None if row["sampling_logprobs"] is None else blob_logprobs(row["sampling_logprobs"])
        row["top_ids"] = None if row["top_ids"] is None else blob_rows(blob_ids, row["top_ids"], n)
        row["top_logprobs"] = None if row["top_logprobs"] is None else blob_rows(blob_logprobs, row["top_logprobs"], n)
        yield {"type": "call", **row}
    for r in conn.execute("SELECT * FROM next_states WHERE created_at >= ? ORDER BY created_at", (since,)):
        row = dict(r)
        row["messages"] = json.loads(row.pop("messages_json"))
        row["reply_matched"] = bool(row["reply_matched"])
        yield {"type": "next_state", **row}
