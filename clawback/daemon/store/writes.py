"""The writes of calls, sessions, feedback, outcomes, samples, training steps and adapters."""

from __future__ import annotations

import json
import sqlite3
import time
from typing import NotRequired, TypedDict

import numpy as np

from clawback.records import Call, FeedbackRecord, JsonObject, JudgedSample, StepRecord, Version

from .notes import NoteWrites
from .schema import (
    ADAPTER_COLUMNS,
    CALL_COLUMNS,
    FEEDBACK_COLUMNS,
    NEXT_STATE_COLUMNS,
    OUTCOME_REWARD_COLUMNS,
    SAMPLE_BLOBS,
    SAMPLE_VERDICT_COLUMNS,
    TRAIN_STEP_COLUMNS,
    VOTE_COLUMNS,
    ids_blob,
    logprobs_blob,
    marks,
)

SIGNAL_KINDS = ("thumbs_up", "thumbs_down", "correction")  # feedback that changes a sample
STEP_EPS = 1e-6  # step credit: the z-score's (v - mean) / (std + STEP_EPS), as upstream's step-wise normalisation


class FeedbackApplied(TypedDict):
    """What became of a feedback event, for its ack (docs/protocol.md)."""

    status: str  # the event's state (applied, orphan, ...), or "duplicate"
    state: NotRequired[str]  # a duplicate's state when it was first stored
    call_id: str | None
    reason: str | None  # why it is an orphan or was ignored


class EventWrites(NoteWrites):
    def _write_call(self, c: Call) -> None:
        self._conn.execute(
            "INSERT INTO sessions(session_id, created_at, last_seen_at) VALUES (?, ?, ?) "
            "ON CONFLICT(session_id) DO UPDATE SET last_seen_at = max(last_seen_at, excluded.last_seen_at)",
            (c.session_id, c.created_at, c.finished_at),
        )
        self._insert("calls", CALL_COLUMNS, {
            "call_id": c.call_id, "session_id": c.session_id, "turn_id": c.turn_id, "request_id": c.request_id,
            "turn_type": c.turn_type, "state": c.state, "created_at": c.created_at, "finished_at": c.finished_at,
            "model": c.model, "adapter_version": Version.name_of(c.adapter_version),
            "request_json": json.dumps(c.request, ensure_ascii=False), "prompt_text": c.prompt_text,
            "prompt_ids": ids_blob(c.prompt_ids), "response_ids": ids_blob(c.response_ids),
            "behaviour_logprobs": logprobs_blob(c.behaviour_logprobs), "response_text": c.response_text,
            "tool_calls_json": json.dumps(c.tool_calls) if c.tool_calls else None,
            "finish_reason": c.finish_reason, "timings_json": json.dumps(c.timings),
            "sampling_logprobs": None if c.sampling_logprobs is None else logprobs_blob(c.sampling_logprobs),
            "top_ids": ids_blob(c.top_ids) if c.top_ids else None,
            "top_logprobs": logprobs_blob(c.top_logprobs) if c.top_logprobs else None})
        self._event(f"call.{c.state}", c.call_id, {"turn_type": c.turn_type})  # no session: events outlive a forget
        if c.turn_type == "main":
            self._resolve_orphans(c)

    def _write_next_state(self, call_id: str, next_call_id: str, messages: list[JsonObject], matched: bool,
                          ts: float) -> None:
        roles = ",".join(m.get("role", "?") for m in messages)
        self._insert("next_states", NEXT_STATE_COLUMNS, {
            "call_id": call_id, "next_call_id": next_call_id, "messages_json": json.dumps(messages, ensure_ascii=False),
            "roles": roles, "reply_matched": int(matched), "created_at": ts})
        self._set_call_state(call_id, "paired", {"next_call_id": next_call_id, "roles": roles})
        self._want_sample(call_id, "next_state")

    def _set_call_state(self, call_id: str, state: str, payload: dict[str, object]) -> None:
        cur = self._conn.execute(
            "UPDATE calls SET state = ? WHERE call_id = ? AND state = 'awaiting_next_state'", (state, call_id)
        )
        if cur.rowcount != 1:
            raise ValueError(f"call {call_id} is not awaiting a next state")
        self._event(f"call.{state}", call_id, payload)

    def _write_close_session(self, session_id: str, reason: str, ts: float) -> None:
        sessions = self._linked_sessions(session_id)  # a linked-in session's waiting call ends here too
        waiting = self._conn.execute(
            f"SELECT call_id FROM calls WHERE session_id IN ({marks(sessions)}) AND state = 'awaiting_next_state'",
            sessions,
        ).fetchall()
        for (call_id,) in waiting:
            self._set_call_state(call_id, "closed_without_next_state", {"reason": reason})
        self._conn.execute(
            "UPDATE sessions SET state = 'closed', closed_at = ?, closed_reason = ? WHERE session_id = ?",
            (ts, reason, session_id),
        )
        self._event("session.closed", None, {"reason": reason})

    def _write_reopen_session(self, session_id: str, ts: float) -> None:
        self._conn.execute(
            "UPDATE sessions SET state = 'open', closed_at = NULL, closed_reason = NULL, last_seen_at = ? "
            "WHERE session_id = ?",
            (ts, session_id),
        )
        self._event("session.reopened", None, {})

    # ---- signals: feedback events, samples, votes ----

    def _write_feedback(self, ev: FeedbackRecord, received_at: float) -> FeedbackApplied:
        row = self._conn.execute(
            "SELECT state, call_id, reason FROM feedback_events WHERE event_id = ?", (ev.event_id,)
        ).fetchone()
        if row is not None:
            return {"status": "duplicate", "state": row[0], "call_id": row[1], "reason": row[2]}
        kind, sid = ev.kind, ev.session_id
        sessions = self._linked_sessions(sid)
        known = self._conn.execute(
            f"SELECT count(*) FROM sessions WHERE session_id IN ({marks(sessions)})", sessions
        ).fetchone()[0] > 0
        call_id = reason = None
        if kind == "session_link":
            self._conn.execute("INSERT OR IGNORE INTO session_links VALUES (?, ?, ?)", (ev.from_, ev.to, received_at))
            # The old id is done, but its waiting call now waits under the new id: close the
            # session without closing that call.
            self._conn.execute(
                "UPDATE sessions SET state = 'closed', closed_at = ?, closed_reason = 'linked' "
                "WHERE session_id = ? AND state = 'open'", (received_at, ev.from_))
            self._event("session.linked", None, {})
            if ev.from_ is None or not self._session_known(ev.from_):
                reason = "unknown_session"
        elif not known:
            reason = "unknown_session"
        elif kind == "session_end":
            self._write_close_session(sid, "session_end", received_at)
        elif kind == "outcome":
            call_id, reason = self._write_outcome(ev, sessions)
        else:
            call_id = self._resolve_target(sessions, ev.target or "last")
            if call_id is None:
                reason = "unknown_target"
        state = "orphan" if reason else "applied"
        self._insert("feedback_events", FEEDBACK_COLUMNS, {
            "event_id": ev.event_id, "kind": kind, "session_id": sid, "target": ev.target,
            "text": ev.text, "source": ev.source, "ts": ev.ts,
            "received_at": received_at, "state": state, "call_id": call_id, "reason": reason,
            "payload": json.dumps(ev.wire(), ensure_ascii=False)})
        self._event(f"feedback.{state}", ev.event_id, {"kind": kind, "call_id": call_id, "reason": reason})
        if kind in ("correction", "thumbs_down") and ev.text and ev.text.strip():
            self._remember(ev.text, kind, call_id, sid, received_at, ev.event_id)
        if call_id is not None and kind in SIGNAL_KINDS:
            self._want_sample(call_id, kind)
        return {"status": state, "call_id": call_id, "reason": reason}

    def _trajectory(self, sessions: list[str], ev: FeedbackRecord) -> list[str]:
        """The main calls an outcome event rates, oldest first: one call (`target`, a request id
        or "last"), one turn (`target`, a turn id), the turns from `turns[0]` to `turns[1]`, or the whole
        session (with the sessions linked to it)."""
        where = f"session_id IN ({marks(sessions)}) AND turn_type = 'main'"
        calls = self._conn.execute(f"SELECT call_id, request_id, turn_id FROM calls WHERE {where} "
                                   "ORDER BY created_at, rowid", sessions).fetchall()
        if ev.target == "last":
            return [c for c, _, _ in calls[-1:]]
        if ev.target:
            one = [c for c, request_id, _ in calls if request_id == ev.target]
            return one[-1:] or [c for c, _, turn_id in calls if turn_id == ev.target]
        if ev.turns:
            first, last = ev.turns
            starts = [i for i, (_, _, turn_id) in enumerate(calls) if turn_id == first]
            ends = [i for i, (_, _, turn_id) in enumerate(calls) if turn_id == last]
            if not starts or not ends or ends[-1] < starts[0]:
                return []
            return [c for c, _, _ in calls[starts[0]:ends[-1] + 1]]
        return [c for c, _, _ in calls]

    def _write_outcome(self, ev: FeedbackRecord, sessions: list[str]) -> tuple[str | None, str | None]:
        """Credit an outcome event's reward to the main calls of the trajectory it rates (docs/
        protocol.md, "Credit assignment"): (the last of them, None), or (None, why not)."""
        trajectory = self._trajectory(sessions, ev)
        if not trajectory:
            return None, "unknown_target"
        credited = list(enumerate(trajectory))
        if ev.credit == "last":
            credited = credited[-1:]
        group = ev.group if ev.credit == "step" else None
        for step, call_id in credited:
            self._insert("outcome_rewards", OUTCOME_REWARD_COLUMNS, {
                "event_id": ev.event_id, "call_id": call_id, "group_id": group, "step": step,
                "raw_reward": ev.reward, "reward": ev.reward})
        changed = {call_id for _, call_id in credited}
        if group is not None:
            changed |= self._normalise_steps(group)
        for call_id in sorted(changed):
            self._want_sample(call_id, "outcome")
        return trajectory[-1], None

    def _normalise_steps(self, group: str) -> set[str]:
        """Step credit: each call's reward is its event's reward z-scored among the group's calls
        at the same step index, clipped to [-1, 1]; a step only one trajectory reached keeps the
        raw reward, and a step where every trajectory got the same reward gets 0. Returns the
        calls whose reward changed."""
        rows = self._conn.execute("SELECT event_id, call_id, step, raw_reward, reward FROM outcome_rewards "
                                  "WHERE group_id = ?", (group,)).fetchall()
        by_step: dict[int, list[sqlite3.Row]] = {}
        for r in rows:
            by_step.setdefault(r["step"], []).append(r)
        changed = set()
        for bucket in by_step.values():
            raw = np.array([r["raw_reward"] for r in bucket], dtype=np.float64)
            if len(raw) == 1:
                new = raw
            elif raw.var() <= 1e-12:
                new = np.zeros_like(raw)
            else:
                new = np.clip((raw - raw.mean()) / (raw.std() + STEP_EPS), -1.0, 1.0)
            for r, value in zip(bucket, new.tolist()):
                if value != r["reward"]:
                    self._conn.execute("UPDATE outcome_rewards SET reward = ? WHERE event_id = ? AND call_id = ?",
                                       (value, r["event_id"], r["call_id"]))
                    changed.add(r["call_id"])
        return changed

    def _resolve_target(self, sessions: list[str], target: str) -> str | None:
        where = f"session_id IN ({marks(sessions)}) AND turn_type = 'main'"
        if target == "last":  # the final main call of the most recent turn: the reply the person saw
            row = self._conn.execute(
                f"SELECT call_id FROM calls WHERE {where} ORDER BY created_at DESC LIMIT 1", sessions
            ).fetchone()
        else:  # a request id names one call; a turn id names the final call of that turn
            row = self._conn.execute(
                f"SELECT call_id FROM calls WHERE {where} AND (request_id = ? OR turn_id = ?) "
                "ORDER BY request_id = ? DESC, created_at DESC LIMIT 1",
                (*sessions, target, target, target),
            ).fetchone()
        return row[0] if row else None

    def _resolve_orphans(self, c: Call) -> None:
        """Feedback that arrived before the call it names was stored is applied now, and the notes
        it made are linked to the call. The reply reaches the person before its call is stored, so
        feedback on "last" in a session with no stored call yet names the first call made before
        it was received; one received before any call of its session was made names none, and
        says so."""
        targets = [t for t in (c.turn_id, c.request_id) if t]
        kinds = SIGNAL_KINDS + ("comment",)
        rows = self._conn.execute(
            f"SELECT event_id, kind, target = 'last' AND received_at < ? FROM feedback_events WHERE state = 'orphan' "
            f"AND session_id = ? AND (target IN ({marks(targets)}) OR (target = 'last' AND reason = 'unknown_session')) "
            f"AND kind IN ({marks(kinds)})",
            (c.created_at, c.session_id, *targets, *kinds),
        ).fetchall()
        for event_id, kind, before_the_call in rows:
            if before_the_call:
                self._conn.execute("UPDATE feedback_events SET reason = 'before_first_call' WHERE event_id = ?",
                                   (event_id,))
                self._link_notes(event_id, None, "before_first_call")
                continue
            self._conn.execute(
                "UPDATE feedback_events SET state = 'applied', call_id = ?, reason = NULL WHERE event_id = ?",
                (c.call_id, event_id),
            )
            self._event("feedback.applied", event_id, {"kind": kind, "call_id": c.call_id, "resolved_orphan": True})
            self._link_notes(event_id, c.call_id)
            if kind in SIGNAL_KINDS:
                self._want_sample(c.call_id, kind)

    def _write_sample(self, sample: JudgedSample) -> bool:
        now = time.time()
        for v in sample.votes:  # every vote is kept, also when the sample itself went stale
            self._insert("votes", VOTE_COLUMNS, {
                "call_id": sample.call_id, "kind": v.kind, "backend": v.backend, "prompt_version": v.prompt_version,
                "score": v.score, "hint": v.hint, "raw": v.raw, "error": v.error, "created_at": now})
        values = {name: getattr(sample, name) for name in SAMPLE_VERDICT_COLUMNS}
        values["teacher_adapter"] = Version.name_of(sample.teacher_adapter)
        if sample.teacher_messages is not None:
            values["teacher_messages"] = json.dumps(sample.teacher_messages, ensure_ascii=False)
        for name, encode in SAMPLE_BLOBS.items():
            if values[name] is not None:
                values[name] = encode(values[name])
        assignments = ", ".join(f"{k} = ?" for k in values)
        cur = self._conn.execute(
            f"UPDATE samples SET {assignments}, updated_at = ? "
            "WHERE call_id = ? AND revision = ? AND state = 'pending_judge'",
            (*values.values(), now, sample.call_id, sample.revision),
        )
        if cur.rowcount != 1:
            return False
        self._event(f"sample.{sample.state}", sample.call_id, {
            "reason": sample.reason, "reward": sample.reward, "reward_source": sample.reward_source,
            "hint": sample.hint is not None})
        if sample.state == "ready":
            self._tell_after_commit(self.on_sample_ready, sample.call_id)
        return True

    def _write_drop_samples(self, call_ids: list[str], reason: str, state: str) -> None:
        n = self._conn.execute(
            f"UPDATE samples SET state = ?, reason = ?, updated_at = ? WHERE state = 'ready' "
            f"AND call_id IN ({marks(call_ids)})", (state, reason, time.time(), *call_ids)).rowcount
        self._event(f"samples.{state}", None, {"reason": reason, "samples": n, "call_ids": call_ids})

    # ---- adapters and training steps ----

    def _write_train_step(self, step: StepRecord) -> int:
        now = time.time()
        metrics = json.dumps(step.metrics)
        self._insert("train_steps", TRAIN_STEP_COLUMNS, {
            "version": step.version, "parent": step.parent, "started_at": step.started_at, "finished_at": now,
            "samples": len(step.call_ids), "outcome": step.outcome, "error": step.error, "metrics": metrics})
        if step.path is not None:
            state = "candidate" if step.candidate else step.outcome
            self._insert("adapters", ADAPTER_COLUMNS, {
                "version": step.version, "parent": step.parent, "path": step.path, "state": state,
                "reason": step.error, "method": step.method, "samples": len(step.call_ids), "metrics": metrics,
                "created_at": now, "updated_at": now})
            self._event(f"adapter.{state}", str(step.version), {"parent": step.parent, "error": step.error})
        if step.outcome != "committed":
            return 0
        consumed = self._conn.execute(
            f"UPDATE samples SET state = 'consumed', consumed_version = ?, updated_at = ? "
            f"WHERE state = 'ready' AND call_id IN ({marks(step.call_ids)})",
            (Version.name_of(step.version), now, *step.call_ids),
        ).rowcount
        self._event("samples.consumed", str(step.version), {"samples": consumed})
        return consumed

    def _write_adapter_live(self, version: int | None) -> None:
        now = time.time()
        # The version that leaves: refused again if it was refused (promoted by hand over the gate,
        # its reason kept); `committed` (good, not live) when a newer version replaces it; else
        # `retired`, rolled back from. Neither of the last two states is what a restart falls back to.
        self._conn.execute(
            "UPDATE adapters SET state = CASE WHEN reason IS NOT NULL THEN 'refused' "
            "WHEN ?1 IS NOT NULL AND ?1 > version THEN 'committed' ELSE 'retired' END, updated_at = ?2 "
            "WHERE state = 'live'", (version, now))
        if version is not None:
            self._conn.execute("UPDATE adapters SET state = 'live', live_at = ?, updated_at = ? WHERE version = ?",
                               (now, now, version))
        self._event("adapter.live", None if version is None else str(version), {})

    def _write_adapter_update(self, version: int, changes: dict[str, object]) -> None:
        assignments = ", ".join(f"{k} = ?" for k in changes)
        self._conn.execute(f"UPDATE adapters SET {assignments}, updated_at = ? WHERE version = ?",
                           (*changes.values(), time.time(), version))
        self._event("adapter.updated", str(version), changes)
