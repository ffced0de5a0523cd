"""The durable store (SQLite): the only code that speaks SQL.

`writer.Store` queues every write to one background thread (writes.py, notes.py, forget.py run
there, inside its transactions) and answers reads on read-only connections (reads.py, queries.py);
schema.py holds the migrations, the columns each write sets and the token blobs.
"""

from .export import export_jsonl
from .forget import ForgetScope
from .reads import counts, opd_counts
from .schema import (
                     ADAPTER_COLUMNS,
                     ADAPTER_STATES,
                     CALL_COLUMNS,
                     FEEDBACK_COLUMNS,
                     MEMORY_NOTE_COLUMNS,
                     NEXT_STATE_COLUMNS,
                     OUTCOME_REWARD_COLUMNS,
                     SAMPLE_BLOBS,
                     SAMPLE_VERDICT_COLUMNS,
                     TRAIN_STEP_COLUMNS,
                     VOTE_COLUMNS,
                     blob_ids,
                     blob_logprobs,
                     blob_rows,
                     connect,
                     ids_blob,
                     linked_sessions,
                     logprobs_blob,
                     migrate,
                     migrations,
)
from .writer import Store, StoreBusy

__all__ = [
    "ADAPTER_COLUMNS", "ADAPTER_STATES", "CALL_COLUMNS", "FEEDBACK_COLUMNS", "MEMORY_NOTE_COLUMNS", "NEXT_STATE_COLUMNS",
    "OUTCOME_REWARD_COLUMNS", "SAMPLE_BLOBS", "SAMPLE_VERDICT_COLUMNS", "TRAIN_STEP_COLUMNS", "VOTE_COLUMNS",
    "ForgetScope", "Store", "StoreBusy", "blob_ids", "blob_logprobs", "blob_rows", "connect", "counts",
    "export_jsonl", "ids_blob", "linked_sessions", "logprobs_blob", "migrate", "migrations", "opd_counts",
]
