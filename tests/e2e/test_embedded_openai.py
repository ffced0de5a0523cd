"""The real daemon on the embedded SmolLM2 model, driven by the official `openai` client.

A 3-turn conversation (streaming and not, a side call in between) must be stored with the exact
sampled token ids, paired with its next states, and every stored behaviour logprob must be
reproduced by re-scoring the stored ids through the engine (token fidelity)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import openai

from clawback.daemon.store import blob_ids, blob_logprobs
from tests.conftest import query, scaled, wait_for


def main_headers(session: str, turn: str, done: bool = False) -> dict[str, str]:
    h = {"X-Session-Id": session, "X-Turn-Type": "main", "X-Turn-Id": turn, "X-Request-Id": f"{turn}:model:1"}
    if done:
        h["X-Session-Done"] = "true"
    return h


def ask(client: openai.OpenAI, messages: list[dict], headers: dict[str, str], stream: bool) -> str:
    kw = dict(model="clawback", messages=messages, max_tokens=48, temperature=0.7, extra_headers=headers)
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content or ""
    pieces, finish = [], None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert finish in ("stop", "length")
    assert len([p for p in pieces if p]) > 1, "tokens must arrive as separate deltas"
    return "".join(pieces)


def wait_rows(db: Path, sql: str, n: int) -> list:
    return wait_for(lambda: (lambda rows: rows if len(rows) >= n else None)(query(db, sql)), what=f"{n} rows")


def test_three_turns_stored_paired_and_token_exact(embedded_model_dir: Path, daemon_factory, tmp_path: Path):
    t0 = time.time()
    d = daemon_factory(embedded_model_dir)
    assert time.time() - t0 < 60, "the daemon answers within 60 s of its start"
    client = openai.OpenAI(base_url=f"{d.url}/v1", api_key=d.api_key, max_retries=0, timeout=scaled(120))
    assert client.models.list().data[0].id == "clawback"

    messages = [{"role": "system", "content": "You are a concise assistant."}]
    users = ["What is the capital of France?", "And of Italy?", "Thanks! Which one is bigger?"]
    replies = []
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        reply = ask(client, messages, main_headers("conv-1", f"run-{i}", done=i == 2), stream=i % 2 == 0)
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
        if i == 0:  # a side call (e.g. a title) between turns is served but never a next state
            client.chat.completions.create(
                model="clawback", max_tokens=8, messages=[{"role": "user", "content": "Title for: " + user}],
                extra_headers={"X-Session-Id": "conv-1", "X-Turn-Type": "side"})

    db = d.data_dir / "clawback.db"
    calls = wait_rows(db, "SELECT * FROM calls WHERE session_id = 'conv-1' AND turn_type = 'main' "
                          "AND state != 'awaiting_next_state' ORDER BY created_at", 3)
    assert [c["state"] for c in calls] == ["paired", "paired", "closed_without_next_state"]
    assert [c["turn_id"] for c in calls] == ["run-0", "run-1", "run-2"]
    side = wait_rows(db, "SELECT state FROM calls WHERE session_id = 'conv-1' AND turn_type = 'side'", 1)
    assert [r["state"] for r in side] == ["served"]

    nexts = wait_rows(db, "SELECT n.*, c.turn_id FROM next_states n JOIN calls c USING (call_id) ORDER BY n.created_at", 2)
    assert [json.loads(n["messages_json"]) for n in nexts] == [
        [{"role": "user", "content": users[1]}], [{"role": "user", "content": users[2]}]]
    assert all(n["reply_matched"] == 1 for n in nexts)

    session = wait_rows(db, "SELECT * FROM sessions WHERE session_id = 'conv-1' AND state = 'closed'", 1)
    assert session[0]["closed_reason"] == "session_done"

    from transformers import AutoTokenizer

    from clawback.engines.embedded import EmbeddedEngine

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    engine = EmbeddedEngine(embedded_model_dir)
    try:
        for call, reply in zip(calls, replies):
            prompt_ids, response_ids = blob_ids(call["prompt_ids"]), blob_ids(call["response_ids"])
            behaviour = blob_logprobs(call["behaviour_logprobs"])
            assert len(response_ids) == len(behaviour) > 0
            assert tok.decode(prompt_ids) == call["prompt_text"]
            # What the client saw is exactly the decoded sampled ids (the end token is not text).
            assert tok.decode(response_ids, skip_special_tokens=True) == reply == call["response_text"]
            rescored = asyncio.run(engine.score(prompt_ids, response_ids))
            worst = max(abs(a - b) for a, b in zip(rescored, behaviour))
            assert worst < 1e-4, f"behaviour logprobs differ from a re-score by {worst}"
    finally:
        asyncio.run(engine.close())

    out = tmp_path / "export.jsonl"
    subprocess.run([sys.executable, "-m", "clawback.daemon.cli", "export", "--jsonl", "--data-dir", str(d.data_dir),
                    "--out", str(out)], check=True)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    exported = [x for x in lines if x["type"] == "call" and x["session_id"] == "conv-1" and x["turn_type"] == "main"]
    assert [x["response_ids"] for x in exported] == [blob_ids(c["response_ids"]) for c in calls]
    assert sum(x["type"] == "next_state" for x in lines) == 2


def test_concurrent_streams_interleave(embedded_model_dir: Path, daemon_factory):
    """Four clients at once: each gets its complete answer, and every stream has produced its first
    token before any stream ends (requests are interleaved, not served one after another)."""
    d = daemon_factory(embedded_model_dir, "--no-auth")
    client = openai.AsyncOpenAI(base_url=f"{d.url}/v1", api_key="unused", max_retries=0, timeout=scaled(120))

    async def one(i: int) -> tuple[float, float, str]:
        first, text = None, ""
        msgs = [{"role": "user", "content": f"Write a long story about the number {i}."}]
        stream = await client.chat.completions.create(
            model="clawback", messages=msgs, max_tokens=32, temperature=0, stream=True)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic()
                text += chunk.choices[0].delta.content
        return first or float("inf"), time.monotonic(), text

    async def run() -> list[tuple[float, float, str]]:
        return await asyncio.gather(*(one(i) for i in range(4)))

    results = asyncio.run(run())
    assert all(text for _, _, text in results)
    assert max(first for first, _, _ in results) < min(end for _, end, _ in results)
