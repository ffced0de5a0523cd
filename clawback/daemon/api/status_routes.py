"""/healthz, /v1/models, /metrics and /v1/status."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .state import AppState


def server_version() -> str:
    from clawback import __version__

    return __version__


def add_status_routes(app: FastAPI, state: AppState) -> None:
    @app.get("/healthz")
    async def healthz() -> dict:
        return {"ok": True}

    @app.get("/v1/models")
    async def models() -> dict:
        info = state.engine.info
        return {
            "object": "list",
            "data": [{
                "id": state.settings.served_model_name,
                "object": "model",
                "created": int(state.started_at),
                "owned_by": "clawback",
                "root": info.name,
                "context_length": info.context_length,
                "max_model_len": info.context_length,
                "adapter_version": state.engine.active_version(),
            }],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    async def status() -> dict:
        counts = await asyncio.to_thread(state.store.counts)
        last_step = await asyncio.to_thread(state.store.last_train_step)
        notes = await asyncio.to_thread(state.store.memory_notes, state.adapters.live())
        return {
            "version": server_version(),
            "model": state.engine.info.name,
            "served_model_name": state.settings.served_model_name,
            "context_length": state.engine.info.context_length,
            "adapter_version": state.engine.active_version(),
            "uptime_s": round(time.time() - state.started_at, 1),
            "generations_running": state.running,
            "sessions_open": state.capture.open_sessions(),
            "capture": dict(state.capture.counters),
            "warnings": [w for w in (state.capture.untrained_warning(),) if w],
            "main_calls": {"last_at": state.capture.last_main_at, "last_tagged_at": state.capture.last_tagged_main_at},
            "signals": {"method": state.pipeline.cfg.method, "teacher": state.pipeline.cfg.teacher,
                        "judge": state.judge_name, "feedback_connections": state.hub.connections()},
            "training": {
                "enabled": state.trainer is not None,
                "batch_size": state.settings.train_config().batch_size,
                "samples_ready": counts.samples.get("ready", 0),
                # Samples with a teacher: top-K OPD, or token-level and why (store.opd_counts).
                "opd": asdict(counts.opd),
                "training_now": bool(state.trainer and state.trainer.busy),
                "trainer_node": state.trainer and state.trainer.trainer_node,  # Ray node id of the last step
                "last_step": last_step,
            },
            # The preference notes main calls get in their system prompt (the extension's /clawback).
            "memory": {"enabled": state.settings.memory, "notes": [
                {"note_id": n.note_id, "text": n.text, "active": n.active, "retired_by": n.retired_by} for n in notes]},
            "gate": await gate_status(state),
            "store": {
                "path": str(state.store.db_path),
                "schema_version": state.store.schema_version,
                "queue_depth": state.store.queue_depth(),
                "written": state.store.written,
                "dropped": dict(state.store.dropped),
                **asdict(counts),
            },
        }


async def gate_status(state: AppState) -> dict[str, object]:
    """The gate's counters and the newest version's fate ("v7 not promoted: <reason>")."""
    rows = await asyncio.to_thread(state.store.adapters)
    newest = rows[-1] if rows else None
    gate, guard = state.gate, state.guard
    return {
        "enabled": gate is not None,
        "reviewing": gate and gate.reviewing,
        "promoted": gate.promoted if gate else 0,
        "refused": gate.refused if gate else 0,
        "last_review_s": gate and gate.last_review_s,
        "newest": newest and {"version": newest.version, "state": newest.state, "reason": newest.reason},
        "guard": {"enabled": guard is not None, "rollbacks": guard.rollbacks if guard else 0,
                  "last": guard and guard.last},
    }
