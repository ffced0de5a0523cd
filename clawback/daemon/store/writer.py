"""Durable store: SQLite in WAL mode, versioned migrations, one background writer.

The serving path never touches the disk: each write is a typed method (`add_call`, `close_session`,
...) that puts it on a bounded queue; a writer thread applies them in order, many per transaction.
Writes whose caller must know the outcome (`apply_feedback`, `write_sample`, `record_step`, ...)
are awaited until committed. If the
queue is ever full the write is counted as dropped (with its kind) and the count is exposed in
/metrics and `clawback status`, and written to the event log once there is room again.

Every state change also appends a row to `events`, which triggers keep append-only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Generic, TypeVar, cast

from clawback.records import Call, FeedbackRecord, JsonObject, JudgedSample, StepRecord

from .forget import ForgetScope, ForgetWrites, Forgotten
from .queries import Queries
from .schema import ADAPTER_STATES, connect, linked_sessions, migrate
from .writes import EventWrites, FeedbackApplied

log = logging.getLogger(__name__)

_STOP = object()


class StoreBusy(RuntimeError):
    pass


T = TypeVar("T")
Reply = Callable[[object, "BaseException | None"], None]
# The write kinds that can change which notes are active: the notes, and the adapters' lineage.
NOTE_WRITES = ("feedback", "memory_edit", "memory_scope", "memory_forget", "memory_retire", "forget", "train_step")


@dataclass(frozen=True)
class _Write(Generic[T]):
    kind: str  # what a drop is counted as
    apply: Callable[[], T]  # runs on the writer thread, inside a transaction
    reply: Reply | None = None  # gets (result, error) once committed


@dataclass(frozen=True)
class _Flush:
    done: threading.Event



class Store(EventWrites, ForgetWrites, Queries):
    def __init__(self, db_path: Path, queue_size: int = 10_000, memory_max_notes: int = 8) -> None:
        self.db_path = Path(db_path)
        self.memory_max_notes = memory_max_notes
        self.db_path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = connect(self.db_path)
        self.schema_version = migrate(self._conn)
        self._queue: queue.Queue[_Write | _Flush | object] = queue.Queue(maxsize=queue_size)
        self.dropped: dict[str, int] = {}
        self._dropped_logged: dict[str, int] = {}
        self.written = 0
        self.on_sample_pending: list[Callable[[str], None]] = []
        self.on_sample_ready: list[Callable[[str], None]] = []
        self._told: list[tuple[list[Callable[[str], None]], str]] = []
        self._scrub_wanted = False  # a forget deleted rows: rewrite the files once it is committed
        self._notes_version = 0  # bumped after a commit that may have changed the preference notes
        self._note_texts: tuple[int, int | None, list[tuple[str, str | None]]] | None = None
        self._thread = threading.Thread(target=self._write_loop, name="clawback-store", daemon=True)
        self._thread.start()

    # ---- writes from the serving path: queued, never block; False = dropped (counted) ----

    def add_call(self, call: Call) -> bool:
        return self._submit(_Write("call", partial(self._write_call, call)))

    def add_next_state(self, call_id: str, next_call_id: str, messages: list[JsonObject], matched: bool,
                       ts: float) -> bool:
        """`next_call_id` brought `messages`, the next state of `call_id`; queues its sample."""
        return self._submit(_Write("next_state", partial(self._write_next_state, call_id, next_call_id, messages,
                                                         matched, ts)))

    def close_call(self, call_id: str, reason: str) -> bool:
        return self._submit(_Write("close_call", partial(self._set_call_state, call_id, "closed_without_next_state",
                                                         {"reason": reason})))

    def close_session(self, session_id: str, reason: str, ts: float) -> bool:
        return self._submit(_Write("close_session", partial(self._write_close_session, session_id, reason, ts)))

    def reopen_session(self, session_id: str, ts: float) -> bool:
        return self._submit(_Write("reopen_session", partial(self._write_reopen_session, session_id, ts)))

    def add_event(self, kind: str, subject: str | None, payload: dict[str, object]) -> bool:
        return self._submit(_Write("event", partial(self._event, kind, subject, payload)))

    # ---- writes that are awaited until committed; StoreBusy when the queue is full ----

    async def apply_feedback(self, event: FeedbackRecord, received_at: float) -> FeedbackApplied:
        """Apply one validated feedback event exactly once; what happened, for the ack."""
        return await self._commit(_Write("feedback", partial(self._write_feedback, event, received_at)))

    async def write_sample(self, sample: JudgedSample) -> bool:
        """Store a judged sample; False when a newer signal re-queued it meanwhile (it is judged again)."""
        return await self._commit(_Write("sample", partial(self._write_sample, sample)))

    async def drop_samples(self, call_ids: Sequence[str], reason: str, state: str = "dropped") -> None:
        """Take ready samples out of training, with the reason: `dropped` (of no use), or
        `quarantined` (training on them failed; a new signal on the call queues it again)."""
        await self._commit(_Write("drop_samples", partial(self._write_drop_samples, list(call_ids), reason, state)))

    async def committed(self) -> None:
        """Returns once every write queued before this call is committed."""
        await self._commit(_Write("barrier", lambda: None))

    async def forget(self, scope: ForgetScope) -> Forgotten:
        """Delete what was stored about the sessions in `scope` (calls, next states, feedback, votes,
        samples, the preference notes learned from them, links, the sessions) and rewrite the database files so that none of it remains in
        them; the event log keeps a tombstone with counts only. Returns the counts, the forgotten
        session ids and the adapter versions trained on the forgotten samples."""
        return await self._commit(_Write("forget", partial(self._write_forget, scope)))

    async def record_step(self, step: StepRecord) -> int:
        """Record a training step; a committed one also records its adapter version and marks its
        samples consumed, in one transaction (so a crash never leaves half of that). Returns the
        number of samples consumed."""
        return await self._commit(_Write("train_step", partial(self._write_train_step, step)))

    async def set_live(self, version: int | None) -> None:
        """`version` (None = base) serves now; the version live before leaves (see _write_adapter_live)."""
        await self._commit(_Write("adapter_live", partial(self._write_adapter_live, version)))

    async def update_adapter(self, version: int, *, pinned: bool | None = None, state: str | None = None,
                             reason: str | None = None, gate: JsonObject | None = None) -> None:
        changes: dict[str, object] = {}
        if pinned is not None:
            changes["pinned"] = int(pinned)
        if reason is not None:
            changes["reason"] = reason
        if gate is not None:  # the gate's report (gate.py)
            changes["gate"] = json.dumps(gate, default=str)
        if state is not None:
            if state not in ADAPTER_STATES:
                raise ValueError(f"unknown adapter state {state!r}")
            changes["state"] = state
        await self._commit(_Write("adapter_update", partial(self._write_adapter_update, version, changes)))

    async def edit_note(self, note_id: int, text: str) -> bool:
        """Replace a preference note's text (False: no such note)."""
        return await self._commit(_Write("memory_edit", partial(self._write_note_edit, note_id, text)))

    async def scope_note(self, note_id: int, scope: str, session_id: str | None = None) -> str | None:
        """Make a note general (`scope` "general") or about one conversation's task ("session":
        `session_id`, by default the session it was learnt from). None when done, else why not."""
        return await self._commit(_Write("memory_scope", partial(self._write_note_scope, note_id, scope, session_id)))

    async def retire_note(self, note_id: int, updated_at: float, version: int, report: dict[str, float]) -> bool:
        """Retire a note as checked against `version` (`report`: the check's numbers, for the
        event); False if it changed since (edited, confirmed again by a new correction) or is gone."""
        return await self._commit(_Write("memory_retire", partial(self._write_retire_note, note_id, updated_at,
                                                                  version, report)))

    async def forget_notes(self, note_id: int | None = None) -> int:
        """Delete one preference note, or all of them (None); returns how many went."""
        return await self._commit(_Write("memory_forget", partial(self._write_forget_notes, note_id)))

    def _submit(self, write: _Write) -> bool:
        try:
            self._queue.put_nowait(write)
            return True
        except queue.Full:
            self.dropped[write.kind] = self.dropped.get(write.kind, 0) + 1
            log.error("store queue full: dropped a %s write (%d so far)", write.kind, self.dropped[write.kind])
            return False

    async def _commit(self, write: _Write[T]) -> T:
        """Queue a write and wait until it is committed; returns its result.

        For writes that are acknowledged to a client (feedback events) or that the caller must know
        landed: raises StoreBusy instead of dropping when the queue is full, so the client keeps
        the event and sends it again.
        """
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def reply(result: object, error: BaseException | None) -> None:
            def settle() -> None:
                if not fut.done():
                    # `result` is what `write.apply` returned: a T
                    fut.set_exception(error) if error is not None else fut.set_result(cast(T, result))

            loop.call_soon_threadsafe(settle)

        try:
            self._queue.put_nowait(replace(write, reply=reply))
        except queue.Full:
            raise StoreBusy("the store is busy; send the event again") from None
        return await fut

    def queue_depth(self) -> int:
        return self._queue.qsize()

    def flush(self, timeout: float = 30.0) -> None:
        """Block until everything submitted so far is committed (tests, shutdown, export)."""
        done = threading.Event()
        self._queue.put(_Flush(done), timeout=timeout)
        if not done.wait(timeout):
            raise TimeoutError("store writer did not drain in time")

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(60)
        self._conn.close()

    # ---- writer thread ----

    def _write_loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < 256:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._apply([w for w in batch if isinstance(w, _Write)])
            for item in batch:
                if isinstance(item, _Flush):
                    item.done.set()
            if any(item is _STOP for item in batch):
                return

    def _apply(self, writes: list[_Write]) -> None:
        if not writes and self.dropped == self._dropped_logged:
            return
        self._told = []
        outcomes: list[tuple[object, BaseException | None]]
        try:
            self._conn.execute("BEGIN IMMEDIATE")
            results = [w.apply() for w in writes]
            self._log_drops()
            self._conn.execute("COMMIT")
            self.written += len(writes)
            outcomes = [(r, None) for r in results]
        except Exception:
            log.exception("store batch failed; retrying its writes one by one")
            self._rollback()
            self._told = []
            outcomes = []
            for w in writes:  # isolate the bad write so the others still land
                n_told = len(self._told)
                try:
                    self._conn.execute("BEGIN IMMEDIATE")
                    result = w.apply()
                    self._conn.execute("COMMIT")
                    self.written += 1
                    outcomes.append((result, None))
                except Exception as e:
                    self._rollback()
                    del self._told[n_told:]
                    self.dropped[f"{w.kind}:error"] = self.dropped.get(f"{w.kind}:error", 0) + 1
                    log.error("store write %s failed and was dropped: %s", w.kind, e)
                    outcomes.append((None, e))
        if any(w.kind in NOTE_WRITES for w in writes):  # after the commit: see note_texts
            self._notes_version += 1
        if self._scrub_wanted:
            self._scrub_wanted = False
            self._scrub()
        for w, (result, error) in zip(writes, outcomes):
            if w.reply is not None:
                w.reply(result, error)
        for listeners, call_id in self._told:
            for listener in listeners:
                try:
                    listener(call_id)
                except Exception:
                    log.exception("store listener failed")


    def _rollback(self) -> None:
        # A BEGIN that failed (database locked past busy_timeout) leaves no transaction open, and
        # a bare ROLLBACK would then raise and kill the writer thread.
        if self._conn.in_transaction:
            self._conn.execute("ROLLBACK")

    def _log_drops(self) -> None:
        if self.dropped != self._dropped_logged:
            self._event("store.dropped", None, {"dropped_total": dict(self.dropped)})
            self._dropped_logged = dict(self.dropped)


    async def note_texts(self, live: int | None, session_id: str) -> list[str]:
        """The texts of the preference notes a main call of `session_id` gets under version `live`
        (the general ones and those of its conversation, active), in `memory_notes` order: read
        off the event loop once, then kept until a commit may have changed them or another version
        serves (every main call gets them; most find them unchanged)."""
        version, cached = self._notes_version, self._note_texts
        if cached is None or cached[:2] != (version, live):
            notes = [(n.text, n.session_id) for n in await asyncio.to_thread(self.memory_notes, live) if n.active]
            cached = self._note_texts = (version, live, notes)  # read after `version`: a later change bumps it again
        notes = cached[2]
        if any(s not in (None, session_id) for _, s in notes):  # another conversation's, or one this continues
            ours = set(await asyncio.to_thread(self.read, lambda c: linked_sessions(c, session_id)))
        else:
            ours = {session_id}
        return [text for text, s in notes if s is None or s in ours]

