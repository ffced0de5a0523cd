"""Retiring preference notes that training has consolidated into the weights.

After a trained version goes live, every note it is served with (`Store.memory_notes`, active)
is checked on the call its correction was about, when that call has teacher logprobs (the stored
reply scored under the person's correction as hint: what the person wanted there). The stored
reply is scored twice, nothing generated:

- by the new version, on the request with its injected notes removed (`memory.strip`): what the
  weights do without being told;
- by the base model, on that request with only this note injected: what the note alone does.

Each is compared with the teacher as the gate's teacher gap (mean per-token |logp − teacher
logp|). When the version's gap is no larger than the note's gap minus `memory_retire_margin`,
the version does without the note what the note did, and the note retires: it is not injected
while this version, or one trained on top of it, serves; a rollback to anything else brings it
back. A note edited or confirmed again by a new correction is active again. Notes without teacher
logprobs (Binary RL alone computes none) never retire. Scoring waits for serving like the gate's
replay, and a check that fails leaves the note as it was.

The reply checked is usually one the version trained on (unless the gate held it out): the check
shows that the weights took in that correction, not that they carry it to new requests; the
gate's replay on held-out calls and the simulator's held-out evaluation measure that.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from clawback.chat import ChatRenderer, ChatRequest
from clawback.engine import Engine
from clawback.records import JsonObject, Version

from . import memory
from .gate import score_when_quiet, teacher_gap
from .store import Store
from .store.reads import MemoryNote

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NoteCheck:
    """One note checked against a version: the teacher gap of the version's reply without the
    note (`gap_live`) and of the base model's with it (`gap_note`)."""

    note_id: int
    gap_live: float
    gap_note: float
    retire: bool  # the version follows the note without being told
    retired: bool = False  # and the note was retired (not when a newer wording replaced it meanwhile)


class NoteRetirement:
    def __init__(self, engine: Engine, renderer: ChatRenderer, store: Store, margin: float = 0.0,
                 busy: Callable[[], int] = lambda: 0, placement: str = "user") -> None:
        self.engine, self.renderer, self.store, self.margin = engine, renderer, store, margin
        self.placement = placement  # where the daemon injects notes (Settings.memory_placement)
        self.busy = busy  # requests being served right now: scoring waits for 0
        self._note_gaps: dict[tuple[int, float], float] = {}  # (note id, updated_at) -> gap with the note, base

    async def check(self, version: int) -> list[NoteCheck]:
        """Check the notes `version` is served with and retire the ones it follows without them;
        one report per note checked. Never raises: a note whose check fails stays as it is."""
        try:
            notes = await asyncio.to_thread(self.store.memory_notes, version)
        except Exception:
            log.exception("memory: cannot read the notes to check against v%d", version)
            return []
        reports = []
        for note in notes:
            if not note.active:
                continue
            try:
                report = await self._check(version, note)
                if report is None:
                    continue
                numbers = {"version": version, "gap_live": report.gap_live, "gap_note": report.gap_note,
                           "margin": self.margin}
                report = replace(report, retired=report.retire and await self.store.retire_note(
                    note.note_id, note.updated_at, version, numbers))
            except Exception as e:
                log.warning("memory: checking note %d against v%d failed, it stays: %s", note.note_id, version, e)
                continue
            # Every check, retired or not, for tuning the margin (numbers only: events outlive a forget).
            self.store.add_event("memory.checked", str(note.note_id), {**numbers, "retired": report.retired})
            reports.append(report)
            log.info("memory: note %d on v%d: gap %.3f without it vs %.3f with it on base%s", note.note_id,
                     version, report.gap_live, report.gap_note, ", retired" if report.retired else "")
        return reports

    async def _check(self, version: int, note: MemoryNote) -> NoteCheck | None:
        if note.call_id is None:  # not learnt from a call yet: nothing to check it on
            return None
        evidence = await asyncio.to_thread(self.store.note_evidence, note.call_id)
        if evidence is None or not evidence.response_ids:
            return None
        body, response, teacher = evidence.request, evidence.response_ids, evidence.teacher_logprobs
        messages = memory.strip(body["messages"], body.get("memory_notes"))
        bare = await self._prompt(body, messages)
        gap_live = teacher_gap(await score_when_quiet(self.engine, self.busy, bare, response, Version.name_of(version)),
                               teacher)
        key = (note.note_id, note.updated_at)
        if key not in self._note_gaps:  # the base model never changes: once per note
            told = await self._prompt(body, memory.inject(messages, [note.text], self.placement))
            self._note_gaps[key] = teacher_gap(await score_when_quiet(self.engine, self.busy, told, response, None),
                                               teacher)
        gap_note = self._note_gaps[key]
        return NoteCheck(note.note_id, round(gap_live, 4), round(gap_note, 4), gap_live <= gap_note - self.margin)

    async def _prompt(self, body: JsonObject, messages: list[JsonObject]) -> list[int]:
        req = ChatRequest.model_validate({**body, "messages": messages})
        return (await asyncio.to_thread(self.renderer.render, req))[1]
