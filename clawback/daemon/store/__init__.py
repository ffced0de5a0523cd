"""The durable store (SQLite): the only code that speaks SQL.

`writer.Store` queues every write to one background thread (writes.py, notes.py, forget.py run
there, inside its transactions) and answers reads on read-only connections (reads.py, queries.py);
schema.py holds the migrations, the columns each write sets and the token blobs.
"""

from .export import export_jsonl
from .forget import ForgetScope
from .reads import counts
from .schema import blob_ids, blob_logprobs, connect, ids_blob, logprobs_blob, migrate, migrations
from .writer import Store, StoreBusy

__all__ = [
    "ForgetScope", "Store", "StoreBusy", "blob_ids", "blob_logprobs", "connect", "counts", "export_jsonl", "ids_blob",
    "logprobs_blob", "migrate", "migrations",
]
