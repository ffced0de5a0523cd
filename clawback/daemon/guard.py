"""The live guard: a version that made things worse after it went live is rolled back.

For the live version it watches a fixed window, its first `guard_replies` main replies, and
counts the ones that got a 👎, the ones that got a correction, and the ones whose tool result or
outcome event said they failed (an agent's command that now errors is as plain a sign as a 👎).
Each rate is compared with the version it replaced (its parent; the newest `guard_baseline` main
replies it served) by Fisher's one-sided exact test, each at `guard_alpha`/3 (Bonferroni over the
three rates). Replies of the
window not yet served or rated count as good, so the p-value can only fall as feedback arrives:
a rollback decided early is the one the full window would decide too, and watching continuously
does not inflate the error rate. A significant rise rolls back through the ordinary hot-swap
(no request fails) and marks the version `refused` with the test's numbers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from math import comb
from typing import NotRequired, TypedDict

from clawback.records import Version

from .adapters import AdapterManager
from .config import GateConfig
from .store import Store
from .store.queries import ReplyFeedback

log = logging.getLogger(__name__)


def fisher_greater(k_new: int, n_new: int, k_old: int, n_old: int) -> float:
    """One-sided p-value of Fisher's exact test for 'the new rate k_new/n_new is higher'."""
    k, n = k_new + k_old, n_new + n_old
    total = comb(n, n_new)
    return sum(comb(k, x) * comb(n - k, n_new - x) for x in range(k_new, min(k, n_new) + 1)) / total


class FeedbackCounts(TypedDict):
    thumbs_down: int
    correction: int
    failed_outcome: int


# The rates the guard tests: (key, label in a reason).
KINDS = (("thumbs_down", "👎"), ("correction", "correction"), ("failed_outcome", "failed tool outcome"))


class GuardCheck(TypedDict):
    """One comparison, as /v1/status shows it and a rolled-back version's `gate` keeps it."""

    version: int
    parent: int | None
    window: int  # the live version's replies compared (`guard_replies`)
    served: int  # of them served so far
    baseline: int  # the parent's replies compared
    new: FeedbackCounts
    old: FeedbackCounts
    tests: dict[str, float]  # kind -> p-value
    rolled_back: NotRequired[str]


@dataclass(frozen=True)
class Rollback:
    """The guard took `version` back to `to` (None = base)."""

    version: Version
    to: Version | None
    reason: str


def _counts(f: ReplyFeedback) -> FeedbackCounts:
    return {"thumbs_down": f.thumbs_down, "correction": f.correction, "failed_outcome": f.failed_outcome}


class LiveGuard:
    def __init__(self, store: Store, adapters: AdapterManager, cfg: GateConfig,
                 on_rollback: Callable[[Rollback], None] = lambda _: None, poll_s: float = 2.0) -> None:
        self.store, self.adapters, self.cfg = store, adapters, cfg
        self.on_rollback = on_rollback
        self.poll_s = poll_s
        self.rollbacks = 0
        self.last: GuardCheck | None = None  # the latest comparison, for /v1/status

    async def run(self) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("live guard check failed")
            await asyncio.sleep(self.poll_s)

    async def check(self) -> GuardCheck | None:
        """Compare the live version with its parent once; roll back on a significant rise."""
        live = self.adapters.live()
        if live is None or self.cfg.guard_replies == 0:
            return None
        rows = {a.version: a for a in await asyncio.to_thread(self.store.adapters)}
        if live not in rows or "promoted_by_hand" in rows[live].gate:
            return None  # a version the person put live stays live
        parent = rows[live].parent
        if parent is not None and parent in rows and rows[parent].state in ("failed", "pruned", "refused"):
            return None  # nothing to go back to
        new, old = await asyncio.to_thread(self._feedback, live, parent)
        n = self.cfg.guard_replies
        result = GuardCheck(version=live, parent=parent, window=n, served=new.replies, baseline=old.replies,
                            new=_counts(new), old=_counts(old), tests={})
        if old.replies == 0:
            self.last = result
            return result
        reasons = []
        alpha = self.cfg.guard_alpha / len(KINDS)
        for kind, label in KINDS:
            k_new, k_old = getattr(new, kind), getattr(old, kind)
            p = fisher_greater(k_new, n, k_old, old.replies)
            result["tests"][kind] = round(p, 5)
            if k_new / n > k_old / old.replies and p < alpha:
                reasons.append(f"{label} rate {k_new}/{n} vs {k_old}/{old.replies} on "
                               f"{Version.name_of(parent) or 'base'} (Fisher one-sided p={p:.3g} < {alpha:.3g})")
        self.last = result
        if reasons and not await asyncio.to_thread(self._by_hand, live) and self.adapters.live() == live:
            reason = "rolled back after going live: " + "; ".join(reasons)
            await self.adapters.rollback(parent, force=True)  # the guard's own choice, whatever the parent's state
            await self.adapters.refuse(live, reason, {"guard": result})
            self.rollbacks += 1
            result["rolled_back"] = reason
            log.warning("live guard: v%d %s", live, reason)
            self.on_rollback(Rollback(Version(live), Version.of(parent), reason))
        return result

    def _by_hand(self, version: int) -> bool:
        """Whether the person has put `version` live by hand (read again: it may have happened
        while the feedback was counted)."""
        return any(a.version == version and "promoted_by_hand" in a.gate for a in self.store.adapters())

    def _feedback(self, live: int, parent: int | None) -> tuple[ReplyFeedback, ReplyFeedback]:
        """The live version's first replies (its window) and the parent's newest ones (the baseline)."""
        return (self.store.reply_feedback(live, self.cfg.guard_replies, newest=False),
                self.store.reply_feedback(parent, self.cfg.guard_baseline, newest=True))
