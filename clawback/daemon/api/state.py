"""The daemon's shared state, which every route reads, and its live Prometheus metrics."""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from clawback.chat import ChatRenderer
from clawback.engine import Engine

from ..capture import Capture
from ..config import Settings
from ..store import Store

if TYPE_CHECKING:
    from clawback.trainer.priority import ServingGauge

    from ..adapters import AdapterManager
    from ..feedback import Hub
    from ..gate import CandidateGate
    from ..guard import LiveGuard
    from ..samples import SamplePipeline
    from ..training import TrainingLoop

log = logging.getLogger(__name__)


def resolve_api_key(settings: Settings) -> str | None:
    """The bearer key: from settings, else <data_dir>/api_key, created on first start."""
    if settings.no_auth:
        return None
    if settings.api_key is not None:
        return settings.api_key.get_secret_value()
    path = settings.api_key_path
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another process may have just created it
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("cb-" + secrets.token_urlsafe(32) + "\n")
            log.warning("created an API key in %s (the key itself is never logged)", path)
    return path.read_text().strip()


class LiveMetrics:
    """Values read from live state at scrape time (queue depth, drops, sessions, capture counters)."""

    def __init__(self, state: AppState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        s = self.state
        yield GaugeMetricFamily("clawback_store_queue_depth", "Writes waiting for the store writer", s.store.queue_depth())
        dropped = CounterMetricFamily("clawback_store_dropped", "Store writes dropped (queue full or write error)", labels=["op"])
        for op, n in s.store.dropped.items():
            dropped.add_metric([op], n)
        yield dropped
        yield CounterMetricFamily("clawback_store_written", "Store writes committed", s.store.written)
        yield GaugeMetricFamily("clawback_generations_running", "Generations in the engine", s.running)
        yield GaugeMetricFamily("clawback_sessions_open", "Open sessions held in memory", s.capture.open_sessions())
        capture = CounterMetricFamily("clawback_capture_events", "Capture outcomes", labels=["kind"])
        for kind, n in s.capture.counters.items():
            capture.add_metric([kind], n)
        yield capture
        yield CounterMetricFamily("clawback_status_pushes_dropped", "Status pushes not sent to a stuck feedback client",
                                  s.hub.dropped)
        yield GaugeMetricFamily("clawback_feedback_connections", "Open feedback WebSockets", s.hub.connections())
        yield GaugeMetricFamily("clawback_adapter_version", "Live adapter version (0 = base model)",
                                s.adapters.live() or 0)
        if s.adapters.last_swap_s is not None:
            yield GaugeMetricFamily("clawback_swap_seconds", "Duration of the last hot-swap", s.adapters.last_swap_s)
        if s.trainer is not None:
            yield CounterMetricFamily("clawback_train_steps", "Committed training steps", s.trainer.steps)
            yield CounterMetricFamily("clawback_train_failures", "Failed training steps", s.trainer.failures)
            train = GaugeMetricFamily("clawback_train", "Metrics of the last training step", labels=["metric"])
            for name, value in (s.trainer.last_metrics or {}).items():
                if isinstance(value, (int, float)):
                    train.add_metric([name], float(value))
            yield train
        if s.gate is not None:
            reviews = CounterMetricFamily("clawback_gate_reviews", "Candidate versions the gate decided on", labels=["outcome"])
            reviews.add_metric(["promoted"], s.gate.promoted)
            reviews.add_metric(["refused"], s.gate.refused)
            yield reviews
            yield GaugeMetricFamily("clawback_gate_reviewing", "Candidate version under review (0 = none)", s.gate.reviewing or 0)
            if s.gate.last_review_s is not None:
                yield GaugeMetricFamily("clawback_gate_seconds", "Duration of the last gate review", s.gate.last_review_s)
        if s.guard is not None:
            yield CounterMetricFamily("clawback_guard_rollbacks", "Versions rolled back by the live guard", s.guard.rollbacks)


@dataclass
class AppState:
    settings: Settings
    engine: Engine
    renderer: ChatRenderer
    store: Store
    capture: Capture
    api_key: str | None
    hub: Hub
    pipeline: SamplePipeline  # started by the lifespan
    adapters: AdapterManager
    trainer: TrainingLoop | None  # started by the lifespan when training is on
    judge_name: str
    gate: CandidateGate | None = None  # candidates are checked before they go live
    guard: LiveGuard | None = None  # rolls back a version that made things worse
    started_at: float = field(default_factory=time.time)
    running: int = 0  # chat requests in flight
    serving_gauge: ServingGauge | None = None  # `running`, for the trainer to yield to
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        self.opd_top_k = self.settings.train_config().opd_top_k  # main calls keep this many top logprobs
        r = self.registry
        self.requests = Counter("clawback_requests", "HTTP requests", ["route", "status"], registry=r)
        self.latency = Histogram("clawback_request_seconds", "Chat completion latency", ["stream"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
        self.ttft = Histogram("clawback_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.tokens = Counter("clawback_tokens", "Tokens processed", ["kind"], registry=r)
        self.calls = Counter("clawback_calls", "Served chat calls", ["turn_type"], registry=r)
        r.register(LiveMetrics(self))

    def count_running(self, delta: int) -> None:
        self.running += delta
        if self.serving_gauge is not None:
            self.serving_gauge.set(self.running)
