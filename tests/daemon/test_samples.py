"""The sample pipeline with a scripted judge (the only fake: it stands in for the judge model's
text), a real SQLite store and a real embedded engine on a tiny random Llama."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import sqlite3
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from clawback.chat import ChatRenderer, ChatRequest
from clawback.daemon.config import Settings
from clawback.daemon.memory import inject
from clawback.daemon.samples import SamplePipeline, degenerate, explicit_reward, repetition_loop, teacher_messages
from clawback.daemon.store import Store, blob_logprobs
from clawback.engine import Token
from clawback.engines.embedded import EmbeddedEngine
from clawback.records import Call, Feedback, FeedbackRecord
from tests.conftest import random_lora


class ScriptedJudge:
    """Answers PRM prompts with `prm` and hint prompts with `hint`, counting calls."""

    name = "scripted"

    def __init__(self, prm: list[str] | str = "ok \\boxed{1}", hint: list[str] | str = "\\boxed{-1}",
                 delay: float = 0.0) -> None:
        self.prm = [prm] if isinstance(prm, str) else list(prm)
        self.hints = [hint] if isinstance(hint, str) else list(hint)
        self.delay = delay
        self.calls = {"prm": 0, "hint": 0}

    async def complete(self, messages, *, temperature, max_tokens, seed=None) -> str:
        await asyncio.sleep(self.delay)
        if "[HINT_START]" in messages[0]["content"]:
            self.calls["hint"] += 1
            return self.hints[(self.calls["hint"] - 1) % len(self.hints)]
        i = self.calls["prm"]
        self.calls["prm"] += 1
        return self.prm[i % len(self.prm)]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    e = EmbeddedEngine(tiny_model_dir)
    yield e
    asyncio.run(e.close())


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> ChatRenderer:
    from transformers import AutoTokenizer

    return ChatRenderer(AutoTokenizer.from_pretrained(str(tiny_model_dir)))


REQUEST = {"model": "clawback", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Explain rain."}]}


def served_call(store: Store, renderer: ChatRenderer, engine: EmbeddedEngine, next_state: list[dict] | None,
                finish_reason: str = "stop", adapter_version: int | None = None,
                response_ids: list[int] | None = None, request: dict[str, Any] = REQUEST,
                top_k: int = 4, top_ids: list[list[int]] | None = None) -> str:
    """A main call as capture stores it, with real sampled ids, behaviour logprobs and top-`top_k`
    (none for 0; `top_ids` replaces the recorded ids)."""
    from clawback.engine import Sampling

    _, prompt_ids = renderer.render(ChatRequest.model_validate(request))

    async def sample():
        sampling = Sampling(temperature=1.0, max_tokens=12, seed=1, top_logprobs=top_k)
        return [t async for t in engine.generate(prompt_ids, sampling)]

    toks = asyncio.run(sample())
    if response_ids is not None:
        toks = [Token(i, -1.0, tuple(i + j for j in range(4)), tuple(-1.0 - j for j in range(4))) for i in response_ids]
    call_id, now = f"chatcmpl-{uuid.uuid4().hex}", time.time()
    store.add_call(Call(
        call_id=call_id, session_id="s", turn_id="t", request_id=call_id, turn_type="main",
        state="awaiting_next_state", created_at=now, finished_at=now, model="tiny",
        request=request, prompt_text="", prompt_ids=prompt_ids, response_ids=[t.id for t in toks],
        behaviour_logprobs=[t.logprob for t in toks], response_text="Rain is water.", tool_calls=None,
        finish_reason=finish_reason, adapter_version=adapter_version,
        top_ids=top_ids or ([list(t.top_ids) for t in toks] if top_k else None),
        top_logprobs=[list(t.top_logprobs) for t in toks] if top_k else None,
        sampling_logprobs=[t.logprob for t in toks]))
    if next_state is not None:
        store.add_next_state(call_id, "next", next_state, True, now)
    store.flush()
    return call_id


def feedback(store: Store, call_kind: str, text: str | None = None) -> None:
    ev = {"event_id": str(uuid.uuid4()), "kind": call_kind, "session_id": "s", "target": "last", "text": text,
          "source": "cli"}
    asyncio.run(store.apply_feedback(FeedbackRecord.of(ev), time.time()))
    store.flush()


def drain(pipeline: SamplePipeline) -> None:
    async def go():
        for call_id, revision in pipeline.store.pending_samples(100):
            await pipeline.process(call_id, revision)

    asyncio.run(go())


def sample_row(store: Store, call_id: str) -> dict[str, Any]:
    conn = sqlite3.connect(store.db_path)
    conn.row_factory = sqlite3.Row
    try:
        return dict(conn.execute("SELECT * FROM samples WHERE call_id = ?", (call_id,)).fetchone())
    finally:
        conn.close()


def votes(store: Store, call_id: str) -> list[tuple]:
    conn = sqlite3.connect(store.db_path)
    try:
        return conn.execute("SELECT kind, backend, prompt_version, score FROM votes WHERE call_id = ? ORDER BY id",
                            (call_id,)).fetchall()
    finally:
        conn.close()


@pytest.fixture
def store(tmp_path: Path):
    s = Store(tmp_path / "db.sqlite")
    yield s
    s.close()


def pipe(store, engine, renderer, judge=None, **cfg) -> SamplePipeline:
    """A pipeline with the settings' defaults (tests/daemon holds no clawback.toml) but for `cfg`."""
    defaults = Settings(data_dir=Path(__file__).parent).signal_config()
    return SamplePipeline(store, engine, renderer, judge, dataclasses.replace(defaults, **{"judge_timeout_s": 10, **cfg}))


NEXT_USER = [{"role": "user", "content": "No, that's wrong, explain it properly."}]


def test_judge_majority_sets_the_reward_and_every_vote_is_kept(store, engine, renderer):
    judge = ScriptedJudge(prm=["\\boxed{-1}", "\\boxed{1}", "bad \\boxed{-1}"])
    call_id = served_call(store, renderer, engine, NEXT_USER)
    drain(pipe(store, engine, renderer, judge, method="binary"))
    row = sample_row(store, call_id)
    assert (row["state"], row["reward"], row["reward_source"], row["judge_score"]) == ("ready", -1.0, "judge", -1)
    assert [v[0] for v in votes(store, call_id)] == ["prm"] * 3
    assert all(v[1] == "scripted" and v[2] == "prm_v1" for v in votes(store, call_id))


def test_tie_and_neutral_scores_give_no_signal(store, engine, renderer):
    call_id = served_call(store, renderer, engine, NEXT_USER)
    judge = ScriptedJudge(prm=["\\boxed{1}", "\\boxed{-1}", "no verdict"])  # 1 vs -1 with one failed: tie -> 0
    drain(pipe(store, engine, renderer, judge, method="binary", judge_retries=0))
    row = sample_row(store, call_id)
    assert (row["state"], row["reason"], row["reward"]) == ("dropped", "no_signal", 0.0)


def test_all_votes_failing_drops_with_a_reason(store, engine, renderer):
    call_id = served_call(store, renderer, engine, NEXT_USER)
    drain(pipe(store, engine, renderer, ScriptedJudge(prm="I cannot decide"), method="binary"))
    assert sample_row(store, call_id)["reason"] == "judge_failed"


def test_explicit_feedback_overrides_the_judge(store, engine, renderer):
    call_id = served_call(store, renderer, engine, NEXT_USER)
    feedback(store, "thumbs_up")
    judge = ScriptedJudge(prm="\\boxed{-1}")
    drain(pipe(store, engine, renderer, judge, method="binary"))
    row = sample_row(store, call_id)
    assert (row["reward"], row["reward_source"]) == (1.0, "explicit")
    assert judge.calls["prm"] == 0, "no judge votes are spent on a call with explicit feedback"
    feedback(store, "thumbs_down")  # a person changes their mind: the last thumbs wins
    assert sample_row(store, call_id)["state"] == "pending_judge"
    drain(pipe(store, engine, renderer, judge, method="binary"))
    assert sample_row(store, call_id)["reward"] == -1.0


def test_correction_is_distilled_into_a_hint_with_teacher_logprobs(store, engine, renderer):
    call_id = served_call(store, renderer, engine, None)
    feedback(store, "correction", "Please use one short sentence and no jargon at all.")
    judge = ScriptedJudge(hint="\\boxed{1} [HINT_START]Answer in one plain short sentence.[HINT_END]")
    drain(pipe(store, engine, renderer, judge, method="opd"))
    row = sample_row(store, call_id)
    assert row["state"] == "ready" and row["hint_source"] == "correction"
    assert row["hint"] == "Answer in one plain short sentence."
    assert row["correction"] == "Please use one short sentence and no jargon at all."
    teacher = blob_logprobs(row["teacher_logprobs"])
    conn = sqlite3.connect(store.db_path)
    (behaviour_blob,) = conn.execute("SELECT behaviour_logprobs FROM calls WHERE call_id = ?", (call_id,)).fetchone()
    conn.close()
    behaviour = blob_logprobs(behaviour_blob)
    assert len(teacher) == len(behaviour) == 12
    assert teacher != pytest.approx(behaviour, abs=1e-4), "the hint changes the context, so the logprobs differ"
    msgs = json.loads(row["teacher_messages"])
    assert msgs[-1]["content"] == "Explain rain.\n\n[Hint for a better reply] Answer in one plain short sentence."
    assert [v[0] for v in votes(store, call_id)] == ["hint"] * 3

    # Top-K OPD: the teacher scored the policy's recorded top-4 at every position, without
    # regenerating; where the sampled token is among them the two views agree.
    ready, = store.ready_samples(10)
    assert len(ready.top_ids) == 12 and all(len(r) == 4 for r in ready.top_ids)
    _, teacher_prompt = renderer.render(ChatRequest.model_validate({**REQUEST, "messages": msgs}))
    expected = asyncio.run(engine.score_candidates(teacher_prompt, ready.response_ids, ready.top_ids))
    flat = [x for row in ready.teacher_top_logprobs for x in row]
    assert flat == pytest.approx([x for row in expected for x in row], abs=1e-4)
    for t, (tok, ids) in enumerate(zip(ready.response_ids, ready.top_ids)):
        if tok in ids:
            assert ready.teacher_top_logprobs[t][ids.index(tok)] == pytest.approx(teacher[t], abs=1e-4)
    assert row["token_level_reason"] is None
    assert asdict(store.counts().opd) == {"top_k": 1, "token_level": 0, "token_level_reasons": {},
                                     "token_level_share": 0.0}


def test_a_sample_that_trains_token_level_records_why(store, engine, renderer, caplog):
    """Without the policy's top-K from serve time, or when the engine cannot score the teacher's
    view of it (here: ids the model does not have, as from a call another model served), the
    sample still trains token-level OPD, and says why; the counts show the share."""
    calls = []
    for kw in ({"top_k": 0}, {"top_ids": [[10**6 + j for j in range(4)]] * 12}, {}):
        calls.append(served_call(store, renderer, engine, None, **kw))
        feedback(store, "correction", "Shorter please.")  # on the session's last call
    drain(pipe(store, engine, renderer, None, method="combined"))
    untopped, foreign, topped = calls
    rows = {c: sample_row(store, c) for c in (untopped, foreign, topped)}
    assert all(r["state"] == "ready" and r["teacher_logprobs"] is not None for r in rows.values())
    assert rows[untopped]["token_level_reason"] == "no_top_k_recorded"
    assert rows[foreign]["token_level_reason"].startswith("candidate_scoring_failed: ")
    assert rows[foreign]["teacher_top_logprobs"] is None and rows[topped]["token_level_reason"] is None
    assert "could not be scored" in caplog.text
    opd = asdict(store.counts().opd)
    assert opd == {"top_k": 1, "token_level": 2, "token_level_share": pytest.approx(2 / 3),
                   "token_level_reasons": {"no_top_k_recorded": 1, "candidate_scoring_failed": 1}}
    trained = {s.call_id: s for s in store.ready_samples(10)}
    assert trained[topped].teacher_top_logprobs is not None
    assert trained[untopped].teacher_top_logprobs is None and trained[foreign].teacher_top_logprobs is None


def test_positive_evidence_is_the_teachers_own_reply_scored_without_the_hint(ending_model_dir, tmp_path):
    """On a model that ends its replies (a random one never does, and a cut reply is no evidence):
    the teacher's greedy reply under the hint is stored with the policy's logprobs of it in the
    original context and the teacher's under the hint; its budget is the request's max_tokens."""
    from transformers import AutoTokenizer

    from clawback.engine import Sampling

    engine = EmbeddedEngine(ending_model_dir)
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(ending_model_dir)))
    store = Store(tmp_path / "db.sqlite")
    try:
        call_id = served_call(store, renderer, engine, None)
        feedback(store, "correction", "Shorter please.")
        drain(pipe(store, engine, renderer, None, method="opd", positive_evidence=True))
        ready, = store.ready_samples(10)
        msgs = json.loads(sample_row(store, call_id)["teacher_messages"])
        _, hinted = renderer.render(ChatRequest.model_validate({**REQUEST, "messages": msgs}))
        sampling = Sampling(temperature=0.0, max_tokens=2 * len(ready.response_ids) + 32,
                            stop_token_ids=engine.info.eos_token_ids)

        async def greedy():
            return [t.id async for t in engine.generate(hinted, sampling)]

        ids = asyncio.run(greedy())
        assert ids[-1] in engine.info.eos_token_ids and ready.evidence_ids == ids
        expected = asyncio.run(engine.score(ready.prompt_ids, ids))
        assert ready.evidence_logprobs == pytest.approx(expected, abs=1e-4)
        # the teacher's logprobs of its reply, as generated, are what scoring it under the hint gives
        assert ready.evidence_teacher_logprobs == pytest.approx(asyncio.run(engine.score(hinted, ids)), abs=1e-3)

        # the teacher gets the room the request gave the reply (without one, twice the reply's)
        budgets, generate = [], engine.generate

        def recording(prompt_ids, sampling, *args, **kw):
            budgets.append(sampling.max_tokens)
            return generate(prompt_ids, sampling, *args, **kw)

        engine.generate = recording
        served_call(store, renderer, engine, None, request={**REQUEST, "max_tokens": 300})
        feedback(store, "correction", "Shorter please.")
        drain(pipe(store, engine, renderer, None, method="opd", positive_evidence=True))
        assert budgets[-1] == 300
    finally:
        store.close()
        asyncio.run(engine.close())


def test_of_several_judge_hints_the_one_closest_to_the_students_top_k_is_used(store, engine, renderer):
    """Three judge votes give three hints; the pipeline keeps the one under which the teacher puts
    the most probability on the student's recorded top-4, which here is not the longest one (the
    pick without top-K)."""
    call_id = served_call(store, renderer, engine, None)
    def mass(hint: str, inp) -> float:
        msgs = teacher_messages(REQUEST["messages"], hint, "instruction", "user")
        _, ids = renderer.render(ChatRequest.model_validate({**REQUEST, "messages": msgs}))
        rows = asyncio.run(engine.score_candidates(ids, inp.response_ids, inp.top_ids))
        return sum(sum(math.exp(x) for x in r) for r in rows)

    feedback(store, "correction", "Please be brief.")
    inp = store.sample_inputs(call_id)
    base = ["Answer in one plain short sentence.", "Mention clouds and rain drops.", "Be friendly, give an example."]
    for pad in ("", " Thanks.", " Thanks a lot.", " Please do that every time."):
        hints = [base[0] + pad + " And keep it simple for a child to follow.", *base[1:]]  # hints[0] is the longest
        masses = {h: mass(h, inp) for h in hints}
        if max(masses, key=masses.get) != hints[0]:
            break
    else:
        pytest.fail(f"could not build hints whose longest is not the closest: {masses}")
    judge = ScriptedJudge(hint=[f"\\boxed{{1}} [HINT_START]{h}[HINT_END]" for h in hints])
    drain(pipe(store, engine, renderer, judge, method="opd"))
    assert sample_row(store, call_id)["hint"] == max(masses, key=masses.get)


@pytest.mark.parametrize("consolidate", [True, False])
def test_a_reply_served_with_notes_trains_without_them(store, engine, renderer, consolidate):
    """Consolidation: the trainer gets the request minus its notes, and as baseline the serving
    version's logprobs there (sampled token and top-K); the teacher keeps the notes and the hint.
    Off, the sample trains as it was served."""
    notes = ["Please start with 'Sure!'."]
    served = {**REQUEST, "memory_notes": notes, "messages": inject(REQUEST["messages"], notes)}
    call_id = served_call(store, renderer, engine, None, request=served)
    feedback(store, "correction", "Please start with 'Sure!'.")
    drain(pipe(store, engine, renderer, None, method="combined", consolidate_notes=consolidate))
    ready, = store.ready_samples(10)
    _, served_prompt = renderer.render(ChatRequest.model_validate(served))
    _, bare_prompt = renderer.render(ChatRequest.model_validate(REQUEST))
    teacher_msgs = json.loads(sample_row(store, call_id)["teacher_messages"])
    assert teacher_msgs[-1]["content"] == ("Explain rain.\n\nPlease start with 'Sure!'.\n\n"
                                           "[Hint for a better reply] Please start with 'Sure!'.")
    if not consolidate:
        assert ready.prompt_ids == served_prompt and ready.sampling_logprobs is not None
        assert ready.served_prompt_ids is None and not ready.distill
        return
    assert ready.prompt_ids == bare_prompt != served_prompt and ready.served_prompt_ids == served_prompt
    assert ready.distill, "its top-K teacher saw the notes: the trainer distils it"
    assert ready.behaviour_logprobs == pytest.approx(
        asyncio.run(engine.score(bare_prompt, ready.response_ids, None)), abs=1e-4)
    expected = asyncio.run(engine.score_candidates(bare_prompt, ready.response_ids, ready.top_ids))
    assert [x for r in ready.top_logprobs for x in r] == pytest.approx([x for r in expected for x in r], abs=1e-4)
    assert ready.sampling_logprobs is None, "no importance weight for the notes"
    served_behaviour = blob_logprobs(sqlite3.connect(store.db_path).execute(
        "SELECT behaviour_logprobs FROM calls WHERE call_id = ?", (call_id,)).fetchone()[0])
    assert ready.behaviour_logprobs != pytest.approx(served_behaviour, abs=1e-4), "the notes change the context"


@pytest.mark.parametrize("method", ["opd", "combined", "binary"])
def test_a_liked_reply_served_with_notes_has_the_notes_for_a_hint(store, engine, renderer, method):
    """A 👍 without a correction gives no hint; consolidating, the notes are the hint: the teacher
    is the request as it was served (notes in), scored on the reply's own tokens, not its top-K
    (what the notes make likely where the reply did not say it would be raised everywhere), and
    the trainer teaches it in the request without them. So OPD keeps a liked reply it would
    otherwise drop for want of a teacher; Binary RL has no use for a teacher and gets none."""
    notes = ["Please start with 'Sure!'."]
    served = {**REQUEST, "memory_notes": notes, "messages": inject(REQUEST["messages"], notes)}
    call_id = served_call(store, renderer, engine, None, request=served)
    feedback(store, "thumbs_up")
    drain(pipe(store, engine, renderer, None, method=method, consolidate_notes=True))
    row = sample_row(store, call_id)
    ready, = store.ready_samples(10)
    _, served_prompt = renderer.render(ChatRequest.model_validate(served))
    _, bare_prompt = renderer.render(ChatRequest.model_validate(REQUEST))
    assert ready.prompt_ids == bare_prompt and ready.served_prompt_ids == served_prompt and ready.reward == 1.0
    if method == "binary":
        assert ready.teacher_logprobs is None and row["hint_source"] is None
        return
    assert row["hint_source"] == "notes" and row["hint"] is None
    assert json.loads(row["teacher_messages"]) == served["messages"]
    assert ready.teacher_logprobs == pytest.approx(
        asyncio.run(engine.score(served_prompt, ready.response_ids, None)), abs=1e-4)
    assert (row["token_level_reason"], row["teacher_top_logprobs"], row["student_top_logprobs"]) == ("notes_teacher", None, None)
    assert ready.teacher_top_logprobs is None and ready.top_ids is None, "the reply's own tokens only"
    assert ready.teacher_logprobs != pytest.approx(ready.behaviour_logprobs, abs=1e-4), "the notes change the context"
    asyncio.run(store.drop_samples([call_id], "held_out"))
    held, = store.held_out_calls(10)
    assert held.reward == 1.0 and held.teacher_logprobs is None, "no corrected behaviour for the gate to measure against"


def test_the_notes_teacher_is_the_base_model_whichever_version_served(store, engine, renderer, tiny_model_dir,
                                                                      tmp_path):
    """A liked reply v1 served with notes: the base model with the notes teaches it (a version as
    its own teacher would chase its own drift), v1 without them is the baseline."""
    asyncio.run(engine.load_adapter("v1", str(random_lora(tiny_model_dir, tmp_path, 1))))
    notes = ["Please start with 'Sure!'."]
    served = {**REQUEST, "memory_notes": notes, "messages": inject(REQUEST["messages"], notes)}
    call_id = served_call(store, renderer, engine, None, request=served, adapter_version=1)
    feedback(store, "thumbs_up")
    drain(pipe(store, engine, renderer, None, method="combined", consolidate_notes=True, teacher="self"))
    row = sample_row(store, call_id)
    ready, = store.ready_samples(10)
    _, served_prompt = renderer.render(ChatRequest.model_validate(served))
    _, bare_prompt = renderer.render(ChatRequest.model_validate(REQUEST))
    assert (row["hint_source"], row["teacher_adapter"]) == ("notes", None)
    base = asyncio.run(engine.score(served_prompt, ready.response_ids, None))
    assert ready.teacher_logprobs == pytest.approx(base, abs=1e-4)
    assert base != pytest.approx(asyncio.run(engine.score(served_prompt, ready.response_ids, "v1")), abs=1e-3)
    assert ready.behaviour_logprobs == pytest.approx(
        asyncio.run(engine.score(bare_prompt, ready.response_ids, "v1")), abs=1e-4), "v1 without the notes"


def test_a_disliked_reply_served_with_notes_trains_as_it_was_served(store, engine, renderer):
    """Without the notes, a 👎's penalty would fall hardest on the tokens the notes asked for."""
    notes = ["Please start with 'Sure!'."]
    served = {**REQUEST, "memory_notes": notes, "messages": inject(REQUEST["messages"], notes)}
    served_call(store, renderer, engine, None, request=served)
    feedback(store, "thumbs_down")
    feedback(store, "correction", "Wrong, it is 4.")
    drain(pipe(store, engine, renderer, None, method="combined", consolidate_notes=True))
    ready, = store.ready_samples(10)
    _, served_prompt = renderer.render(ChatRequest.model_validate(served))
    assert ready.reward == -1.0 and ready.teacher_logprobs is not None
    assert ready.prompt_ids == served_prompt and ready.served_prompt_ids is None and not ready.distill


@pytest.mark.parametrize("consolidate", [True, False])
def test_a_disliked_replys_evidence_trains_without_the_notes(ending_model_dir, tmp_path, consolidate):
    """v1 served a disliked reply with notes. The reply trains as served, but its teacher's own
    reply is what the notes and the hint led to: consolidating, it is written by the base model
    (the notes' teacher, as for a liked reply) and scored by v1 in the request without the notes,
    where it trains; otherwise v1 writes it, scored where the reply was served (a model that ends
    its replies: a cut teacher reply is no evidence)."""
    from transformers import AutoTokenizer

    engine = EmbeddedEngine(ending_model_dir)
    asyncio.run(engine.load_adapter("v1", str(random_lora(ending_model_dir, tmp_path, 1))))
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(str(ending_model_dir)))
    store = Store(tmp_path / "db.sqlite")
    notes = ["Please start with 'Sure!'."]
    served = {**REQUEST, "memory_notes": notes, "messages": inject(REQUEST["messages"], notes)}
    writers, generate = [], engine.generate

    def recording(prompt_ids, sampling, adapter=None, **kw):
        writers.append(adapter)
        return generate(prompt_ids, sampling, adapter, **kw)

    try:
        call_id = served_call(store, renderer, engine, None, request=served, adapter_version=1)
        feedback(store, "thumbs_down")
        feedback(store, "correction", "Start with 'Sure!'.")
        engine.generate = recording
        drain(pipe(store, engine, renderer, None, method="combined", consolidate_notes=consolidate,
                   positive_evidence=True, teacher="self"))
        assert writers == [None if consolidate else "v1"], "who wrote the evidence"
        ready, = store.ready_samples(10)
        _, served_prompt = renderer.render(ChatRequest.model_validate(served))
        _, bare_prompt = renderer.render(ChatRequest.model_validate(REQUEST))
        msgs = json.loads(sample_row(store, call_id)["teacher_messages"])
        _, hinted = renderer.render(ChatRequest.model_validate({**REQUEST, "messages": msgs}))
        assert ready.prompt_ids == served_prompt and ready.evidence_ids
        context = bare_prompt if consolidate else served_prompt
        assert ready.evidence_prompt_ids == (bare_prompt if consolidate else None)
        assert ready.evidence_logprobs == pytest.approx(
            asyncio.run(engine.score(context, ready.evidence_ids, "v1")), abs=1e-4)
        assert ready.evidence_teacher_logprobs == pytest.approx(
            asyncio.run(engine.score(hinted, ready.evidence_ids, writers[0])), abs=1e-3)
    finally:
        store.close()
        asyncio.run(engine.close())


@pytest.mark.parametrize("consolidate, rated", [(False, True), (True, False)])
def test_no_teacher_for_a_reply_without_a_hint_unless_consolidating_a_liked_one(store, engine, renderer,
                                                                                  consolidate, rated):
    """Unrated, the serving version's own reply with the notes is no evidence that it follows them;
    with nothing to train on it is not scored again without the notes."""
    notes = ["Please start with 'Sure!'."]
    served = {**REQUEST, "memory_notes": notes, "messages": inject(REQUEST["messages"], notes)}
    call_id = served_call(store, renderer, engine, [{"role": "user", "content": "And what about snow?"}],
                          request=served)
    if rated:
        feedback(store, "thumbs_up")
    drain(pipe(store, engine, renderer, None, method="opd", consolidate_notes=consolidate))
    row = sample_row(store, call_id)
    assert (row["state"], row["reason"], row["teacher_logprobs"], row["hint_source"]) == ("dropped", "no_signal", None, None)
    assert row["student_prompt_ids"] is None


def test_the_self_teacher_is_the_version_that_served_the_call(store, engine, renderer):
    """v9 served the call but is not loaded any more: the sample gets no teacher (recorded), rather
    than being scored by whichever version is live."""
    call_id = served_call(store, renderer, engine, None, adapter_version=9)
    feedback(store, "correction", "Shorter please.")
    drain(pipe(store, engine, renderer, None, method="opd"))
    row = sample_row(store, call_id)
    assert (row["state"], row["reason"], row["teacher_logprobs"]) == ("dropped", "teacher_version_unloaded", None)


@pytest.mark.parametrize("finish_reason, ids, drop_cut, outcome", [
    ("length", None, True, ("dropped", "cut_off")),
    ("length", None, False, ("ready", None)),  # by default a rated cut reply is still trained on
    ("stop", [], False, ("dropped", "empty_reply")),
    ("stop", [5, 6, 7, 8, 9, 10] * 3 + [11], False, ("dropped", "repetition_loop")),
])
def test_degenerate_replies_are_dropped_with_a_reason(store, engine, renderer, finish_reason, ids, drop_cut, outcome):
    call_id = served_call(store, renderer, engine, None, finish_reason=finish_reason, response_ids=ids)
    feedback(store, "thumbs_down")
    drain(pipe(store, engine, renderer, None, method="binary", drop_cut_replies=drop_cut))
    assert (sample_row(store, call_id)["state"], sample_row(store, call_id)["reason"]) == outcome


def test_degenerate():
    assert degenerate([1, 2, 3, 4, 5, 6, 7], "stop") is None
    assert degenerate([1, 2, 3] * 6, "stop") == "repetition_loop"
    assert degenerate([1, 2, 3] * 6, "stop", liked=True) is None
    assert degenerate([1, 2, 3], "tool_calls") is None
    assert repetition_loop([1, 2, 3] * 6) == (3, 9)  # "1 2 3" said again from position 3
    assert repetition_loop([9, 8] + [1, 2, 3, 4, 5, 6, 7] * 3) == (9, 15)
    assert repetition_loop([1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6]) is None  # twice is not a loop


@pytest.mark.parametrize("finish_reason, drop_cut", [("stop", False), ("length", True)])
@pytest.mark.parametrize("method", ["binary", "opd", "combined"])
def test_a_looping_reply_trains_against_its_first_repeat(store, engine, renderer, finish_reason, drop_cut, method):
    """With loop training on, a reply that loops and was marked wrong is not dropped: its sample
    keeps the reply up to the end of the loop's first repeat, marks where that repeat starts, and
    carries no teacher (also when cut off, and for every method); the person's 👎 is kept on the
    record."""
    ids = [40, 41] + [5, 6, 7, 8, 9, 10, 11] * 4
    call_id = served_call(store, renderer, engine, None, finish_reason=finish_reason, response_ids=ids)
    feedback(store, "thumbs_down")
    feedback(store, "correction", "Don't repeat yourself.")
    drain(pipe(store, engine, renderer, None, method=method, drop_cut_replies=drop_cut, train_loops=True))
    row = sample_row(store, call_id)
    assert (row["state"], row["reason"], row["loop_from"], row["loop_to"]) == ("ready", None, 9, 15)
    assert (row["reward"], row["reward_source"], row["teacher_logprobs"]) == (-1.0, "explicit", None)
    [ready] = store.ready_samples(10)
    assert (ready.loop_from, ready.response_ids) == (9, ids[:15])
    assert len(ready.behaviour_logprobs) == len(ready.sampling_logprobs or ready.behaviour_logprobs) == 15


def test_a_loop_not_marked_wrong_is_still_dropped(store, engine, renderer):
    """A 6-token run said three times in a reply the person did not rate is a restated phrase as
    often as a loop: nothing to train against."""
    call_id = served_call(store, renderer, engine, NEXT_USER, response_ids=[40, 41] + [5, 6, 7, 8, 9, 10, 11] * 3)
    drain(pipe(store, engine, renderer, None, method="combined", train_loops=True))
    assert (sample_row(store, call_id)["state"], sample_row(store, call_id)["reason"]) == ("dropped", "repetition_loop")


@pytest.mark.parametrize("ids, outcome", [
    ([40, 41] + [5, 6, 7, 8, 9, 10, 11] * 3, ("ready", None)),  # a phrase said again: trained
    ([40, 41] + [5, 6, 7] * 20, ("dropped", "repetition_loop")),  # it ends in a loop: dropped all the same
])
def test_a_liked_reply_that_restates_a_phrase_is_trained_on(store, engine, renderer, ids, outcome):
    """What the person liked is material unless it ends in a loop: step-by-step work that names
    its quantities again says the same 6 tokens three times without looping."""
    call_id = served_call(store, renderer, engine, NEXT_USER, response_ids=ids)
    feedback(store, "thumbs_up")
    drain(pipe(store, engine, renderer, None, method="combined"))
    assert (sample_row(store, call_id)["state"], sample_row(store, call_id)["reason"]) == outcome


def test_without_a_judge_the_raw_correction_is_the_hint(store, engine, renderer):
    call_id = served_call(store, renderer, engine, None)
    feedback(store, "correction", "Shorter please.")
    drain(pipe(store, engine, renderer, None, method="combined", teacher="base"))
    row = sample_row(store, call_id)
    assert (row["state"], row["hint"], row["hint_source"], row["teacher"], row["teacher_adapter"]) == (
        "ready", "Shorter please.", "correction_raw", "base", None)


@pytest.mark.parametrize("correction_reward", [0.0, -1.0])
def test_without_a_judge_a_correction_is_a_thumbs_down_only_when_asked(store, engine, renderer, correction_reward):
    """Binary RL has no reward for a typed correction unless `correction_reward` gives it one; a
    👍 on the same reply still wins."""
    corrected = served_call(store, renderer, engine, None)
    feedback(store, "correction", "Shorter please.")
    drain(pipe(store, engine, renderer, None, method="binary", correction_reward=correction_reward))
    row = sample_row(store, corrected)
    want = ("ready", -1.0, "explicit") if correction_reward else ("dropped", 0.0, "none")
    assert (row["state"], row["reward"], row["reward_source"]) == want
    liked = served_call(store, renderer, engine, None)
    feedback(store, "correction", "Also add the units.")
    feedback(store, "thumbs_up")
    drain(pipe(store, engine, renderer, None, method="binary", correction_reward=correction_reward))
    assert (sample_row(store, liked)["state"], sample_row(store, liked)["reward"]) == ("ready", 1.0)


def test_next_state_without_judge_or_feedback_is_dropped_with_no_signal(store, engine, renderer):
    call_id = served_call(store, renderer, engine, NEXT_USER)
    drain(pipe(store, engine, renderer, None))
    assert (sample_row(store, call_id)["state"], sample_row(store, call_id)["reason"]) == ("dropped", "no_signal")


def test_a_signal_arriving_while_judging_is_not_overwritten(store, engine, renderer):
    """The judge is slow; a 👍 lands meanwhile. The stale judge result is not written; the sample
    is judged again with the new signal."""
    call_id = served_call(store, renderer, engine, NEXT_USER)
    judge = ScriptedJudge(prm="\\boxed{-1}", delay=0.3)
    p = pipe(store, engine, renderer, judge, method="binary")

    async def go():
        (cid, revision), = store.pending_samples()
        task = asyncio.create_task(p.process(cid, revision))
        await asyncio.sleep(0.1)
        await asyncio.to_thread(feedback, store, "thumbs_up")
        await task
        assert sample_row(store, call_id)["state"] == "pending_judge"
        (cid, revision2), = store.pending_samples()
        assert revision2 == revision + 1
        await p.process(cid, revision2)

    asyncio.run(go())
    row = sample_row(store, call_id)
    assert (row["state"], row["reward"], row["reward_source"]) == ("ready", 1.0, "explicit")


def test_teacher_context_building():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": [{"type": "text", "text": "c"}]}, {"role": "tool", "content": "d"}]
    out = teacher_messages(msgs, "be kind")
    assert out[2]["content"][-1] == {"type": "text", "text": "[Hint for a better reply] be kind"}
    assert out[0] == msgs[0] and msgs[2]["content"] == [{"type": "text", "text": "c"}], "input untouched"
    assert teacher_messages([{"role": "system", "content": "x"}], "h")[-1] == {"role": "user", "content": "[Hint for a better reply] h"}
    in_system = teacher_messages(msgs, "be kind", "instruction", "system")
    assert in_system[0] == {"role": "system", "content": "When you write your reply, follow this instruction from "
                                                         "the user about it: be kind"}
    assert in_system[1:] == msgs
    assert explicit_reward([Feedback(k, None, 0.0) for k in ("thumbs_up", "comment", "thumbs_down")]) == -1.0
    assert explicit_reward([Feedback("correction", "shorter", 0.0)]) is None


def test_zero_signal_samples_count_toward_the_batch_when_asked(store, engine, renderer):
    # The seed recipe keeps a no-signal sample ready (reward 0) so it fills a batch slot.
    call_id = served_call(store, renderer, engine, NEXT_USER)
    drain(pipe(store, engine, renderer, None, method="combined", count_zero_signal=True))
    row = sample_row(store, call_id)
    assert (row["state"], row["reason"], row["reward"], row["teacher_logprobs"]) == ("ready", None, 0.0, None)
    assert store.ready_count() == 1


def stored_reply(store: Store, session: str, response_ids: list[int], text: str, finish_reason: str) -> str:
    """A main call with the given reply (as capture stores a cut or failed generation)."""
    call_id, now = f"chatcmpl-{uuid.uuid4().hex}", time.time()
    store.add_call(Call(
        call_id=call_id, session_id=session, turn_id="t", request_id=call_id, turn_type="main",
        state="awaiting_next_state", created_at=now, finished_at=now, model="tiny", adapter_version=None,
        request=REQUEST, prompt_text="", prompt_ids=[1, 2, 3], response_ids=response_ids,
        behaviour_logprobs=[-1.0] * len(response_ids), response_text=text, tool_calls=None,
        finish_reason=finish_reason))
    asyncio.run(store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": "thumbs_up", "session_id": session,
                                      "target": "last", "source": "cli"}), time.time()))
    return call_id


def test_empty_and_degenerate_replies_never_become_samples(store, engine, renderer):
    """A 👍 on a reply with no tokens made a ready sample the trainer rejects on every step."""
    empty = stored_reply(store, "a", [], "", "cancelled")
    blank = stored_reply(store, "b", [2], "", "stop")  # only the end token
    loop = stored_reply(store, "c", [5, 6, 7] * 3 + [9, 10] * 30, "ab" * 30, "length")
    good = stored_reply(store, "d", list(range(40, 80)), "Rain is water falling from clouds.", "stop")
    drain(pipe(store, engine, renderer, method="binary"))
    assert {c: (sample_row(store, c)["state"], sample_row(store, c)["reason"]) for c in (empty, blank, loop, good)} == {
        empty: ("dropped", "empty_reply"), blank: ("dropped", "no_content"),
        loop: ("dropped", "repetition_loop"), good: ("ready", None)}
