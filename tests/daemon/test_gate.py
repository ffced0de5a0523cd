"""The candidate gate on the embedded model with real adapters: a broken one, one trained to say
the same phrase whatever it is asked, and a good one."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest
import torch

from clawback.adapter_format import publish
from clawback.chat import ChatRenderer, ChatRequest
from clawback.daemon.config import GateConfig
from clawback.daemon.gate import CandidateGate
from clawback.daemon.memory import inject
from clawback.daemon.store import Store
from clawback.daemon.store.queries import HealthPoint
from clawback.engines.embedded import EmbeddedEngine
from clawback.records import Call, FeedbackRecord, JudgedSample, StepRecord
from clawback.trainer.config import TrainConfig
from clawback.trainer.step import Sample, make_lora_model, make_optimizer, train_step

# Probes the base model answers correctly with few tokens: a fall below it is visible at once.
PROBES = ("arithmetic-01", "arithmetic-04", "arithmetic-09", "arithmetic-11", "fact-01", "fact-02", "fact-03",
          "fact-04", "fact-11", "fact-13", "format-12", "format-13")
PHRASE = "I love bananas! Bananas are the best fruit."
TRAIN_PROMPTS = ("Tell me about the moon.", "How do I boil an egg?", "What is a noun?", "Name a big city.",
                 "Why is the sea salty?", "Give me a tip for sleeping well.", "What does a cat eat?",
                 "How many wheels does a bike have?")


@pytest.fixture(scope="module")
def rig(embedded_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("gate")
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir))
    renderer = ChatRenderer(tok)
    engine = EmbeddedEngine(embedded_model_dir, device="cpu", torch_threads=1)
    store = Store(tmp / "db.sqlite")
    gate = CandidateGate(engine, renderer, store, GateConfig(probe_max_tokens=16))
    gate.probes = [p for p in gate.probes if p.id in PROBES]
    yield {"engine": engine, "store": store, "gate": gate, "renderer": renderer, "tok": tok,
           "root": tmp / "adapters", "model_dir": embedded_model_dir}
    asyncio.run(engine.close())
    store.close()


def prompt_ids(renderer: ChatRenderer, text: str, notes: list[str] = ()) -> list[int]:
    return renderer.render(ChatRequest(model="m", messages=inject([{"role": "user", "content": text}], list(notes))))[1]


def make_adapter(rig, version: int, train: list[tuple[str, str]] = (), steps: int = 0, lr: float = 1e-4,
                 noise: float = 0.0, notes: list[str] = ()) -> str:
    """A real LoRA version: trained with Binary RL (+1 on each reply; its prompts told `notes`)
    and/or with random weights."""
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(method="binary", lora_rank=8, lora_alpha=16, lr=lr, tis_cap=None, seed=version)
    model = make_lora_model(AutoModelForCausalLM.from_pretrained(str(rig["model_dir"])), cfg)
    opt = make_optimizer(model, cfg)
    eos = rig["tok"].convert_tokens_to_ids("<|im_end|>")
    samples = [Sample(prompt_ids=prompt_ids(rig["renderer"], p, notes),
                      response_ids=rig["tok"](r, add_special_tokens=False)["input_ids"] + [eos],
                      behaviour_logprobs=[-1.0] * (len(rig["tok"](r, add_special_tokens=False)["input_ids"]) + 1),
                      reward=1.0) for p, r in train]
    for _ in range(steps):
        train_step(model, opt, samples, cfg)
    if noise:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.normal_(0, noise)
    path = publish(rig["root"], version, model, opt, {"method": "binary"})
    asyncio.run(rig["store"].record_step(StepRecord(version, None, time.time(), "binary", (), "committed",
                                                    candidate=True, path=str(path))))
    asyncio.run(rig["engine"].load_adapter(f"v{version}", str(path)))
    return str(path)


def served_call(rig, prompt: str, reply: str, turn_type: str = "main") -> str:
    """A call as the daemon stores it after serving it; returns its id."""
    ids = prompt_ids(rig["renderer"], prompt)
    response = rig["tok"](reply, add_special_tokens=False)["input_ids"]
    call_id = str(uuid.uuid4())
    rig["store"].add_call(Call(call_id, "s1", None, call_id, turn_type, "awaiting_next_state", time.time(), time.time(),
                               "m", None, {"messages": [{"role": "user", "content": prompt}]}, "", ids, response,
                               [-1.0] * len(response), reply, None, "stop"))
    return call_id


def rated_call(rig, prompt: str, reply: str, kind: str = "thumbs_up") -> str:
    """A served call the person rated: it has a sample, waiting for the judge."""
    call_id = served_call(rig, prompt, reply)
    asyncio.run(rig["store"].apply_feedback(FeedbackRecord.of(
        {"event_id": str(uuid.uuid4()), "kind": kind, "session_id": "s1", "target": call_id}), time.time()))
    return call_id


def held_out_call(rig, prompt: str, reply: str, kind: str) -> None:
    """A rated call in the held-out share, as the store holds it after the training loop set it aside."""
    call_id = rated_call(rig, prompt, reply, kind)
    asyncio.run(rig["store"].write_sample(JudgedSample(call_id, 0, "dropped", reason="held_out", reward_source="explicit",
                                                       reward=1.0 if kind == "thumbs_up" else -1.0)))


def review(rig, version: int, metrics: dict | None = None):
    return asyncio.run(rig["gate"].review(version, None, metrics or {"loss": 0.1, "grad_norm": 1.0}))


def test_a_broken_adapter_is_refused_for_lost_capability(rig):
    make_adapter(rig, 1, noise=0.5)  # large random LoRA weights
    verdict = review(rig, 1)
    assert not verdict.promote
    assert verdict.reasons[0].startswith("retention −"), verdict.reasons
    r = verdict.report.retention
    assert r.base >= 75 and r.candidate < r.base - 2  # the base answers most of these; v1 does not
    assert "Paris" in rig["gate"]._probe_cache[None].replies["fact-01"]  # the score is read from real replies
    newly = verdict.report.newly_failed  # the candidate's replies where the base model was right
    assert newly and len(newly) * 100 / len(PROBES) >= r.base - r.candidate, newly


def test_an_adapter_that_repeats_one_phrase_is_refused_as_collapse_and_by_replay(rig):
    for p in ("What is the capital of Spain?", "Name a color.", "What do cows drink?"):
        held_out_call(rig, p, PHRASE, "thumbs_down")
    for p, r in (("What is 1 + 1?", "1 + 1 = 2."), ("Name a planet.", "Mars is a planet."),
                 ("What do fish live in?", "Fish live in water.")):
        held_out_call(rig, p, r, "thumbs_up")
    make_adapter(rig, 2, train=[(p, PHRASE) for p in TRAIN_PROMPTS], steps=12, lr=3e-3)
    verdict = review(rig, 2)
    assert not verdict.promote
    replies = verdict.report.collapse.candidate
    assert any("same reply to different prompts" in r for r in verdict.reasons), (verdict.reasons, replies)
    # The person's own held-out requests, answered greedily: the same phrase whatever they asked.
    own = verdict.report.collapse_own_requests
    assert own.calls == 6 and own.candidate.self_similarity > own.live.self_similarity
    assert any(r.startswith("collapse (your requests): same reply") for r in verdict.reasons), verdict.reasons
    assert any(r.startswith("replay: liked−disliked margin") for r in verdict.reasons), verdict.reasons
    margin = verdict.report.replay.margin
    assert isinstance(margin, dict) and margin["candidate"] < margin["live"]


def test_with_disliked_calls_only_the_replay_checks_them_alone_and_refuses(rig):
    """v2 (trained to say PHRASE, above) against only the held-out calls where PHRASE got a 👎:
    too few of each kind for a margin, and the disliked reply became more likely."""
    gate = rig["gate"]
    disliked = [i for i in gate._held_out_calls() if i.reward == -1.0]
    out, reasons = asyncio.run(gate._replay(disliked, "v2", None))
    assert isinstance(out.margin, str) and out.margin.startswith("one-sided: 0 liked and 3 disliked"), out
    assert out.mean_logprob["candidate"]["disliked"] > out.mean_logprob["live"]["disliked"]
    assert any(r.startswith("replay: disliked replies more likely") for r in reasons), reasons


def test_a_good_adapter_passes(rig):
    good = [("What is 2 + 2?", "2 + 2 = 4."), ("What is the capital of Peru?", "The capital of Peru is Lima."),
            ("Name a fruit.", "An apple is a fruit.")]
    make_adapter(rig, 3, train=good, steps=2, lr=1e-4)
    verdict = review(rig, 3)
    assert verdict.promote, verdict.reasons
    assert verdict.report.retention.candidate >= verdict.report.retention.base - 2
    assert isinstance(verdict.report.replay.margin, dict)  # the held-out calls were replayed
    assert verdict.report.collapse_own_requests.calls == 6  # and answered, without an alarm


def test_unhealthy_training_is_refused_without_evaluation(rig):
    gate = rig["gate"]
    gate._history = [HealthPoint(loss=0.1, grad_norm=2.0)] * 5
    verdict = review(rig, 3, {"loss": 0.1, "grad_norm": 556.0})
    assert not verdict.promote and "gradient norm 556" in verdict.reason
    assert verdict.report.retention is None and "v3" not in gate._probe_cache  # no probe was run
    assert list(verdict.report.json()) == ["health", "seconds"] and json.dumps(verdict.report.json())  # stored as JSON


def test_the_persons_newest_requests_stand_in_for_missing_held_out_calls(rig):
    """With fewer held-out calls than `replay_generate`, the collapse detectors answer the newest
    main calls' prompts as well: each prompt once, only calls with a sample (never a side call's,
    nor a one-off call that nothing followed, such as an evaluation)."""
    gate, store = rig["gate"], rig["store"]
    for prompt in ("What is 5 + 5?", "How many legs does a spider have?", "How many legs does a spider have?",
                   "What is 3 + 4?"):
        rated_call(rig, prompt, "Eight.")
    served_call(rig, "Give this chat a title.", "Spiders", turn_type="side")
    served_call(rig, "What is the capital of Chile?", "Santiago.")  # newest, but no sample
    store.flush()
    spider, sum_ = prompt_ids(rig["renderer"], "How many legs does a spider have?"), prompt_ids(rig["renderer"], "What is 3 + 4?")
    newest = [p.prompt_ids for p in gate._recent_prompts(3, set(), [])]
    assert newest == [sum_, spider, prompt_ids(rig["renderer"], "What is 5 + 5?")]  # newest first, each prompt once
    # not the side call's title request, nor the newest main call, which nothing followed
    again = [p.prompt_ids for p in gate._recent_prompts(3, set(), [spider])]
    assert spider not in again  # a prompt already chosen is not taken again
    held_out = gate._held_out_calls()[:1]
    make_adapter(rig, 4)  # this test's own candidate: the others' versions may not be loaded
    own = asyncio.run(gate._own_requests(held_out, "v4", None))
    # this test's three prompts at least (earlier tests' calls may add to them), never more than asked
    assert own is not None and 3 <= own.calls <= gate.cfg.replay_generate and own.base is None  # live is the base
    assert 0.0 <= own.candidate.refusal_rate <= 1.0


NOTE_PROMPTS = ("What is 3 + 5?", "How many days are in a week?", "What colour is the sky?")
NOTE_TRAIN = ("What is 2 + 2?", "Name a big city.", "What do cows drink?", "How many legs does a dog have?",
              "What is the capital of Italy?", "Why is the sea salty?")


def test_a_candidate_that_no_longer_does_what_the_notes_ask_when_told_is_refused(rig):
    """Liked replies served with the note "start with 'Great question!'" (and a disliked one, which
    stands for nothing): a candidate trained to
    open told replies with "Sure, I'd be happy to help!" puts less on the tokens the note led the
    base model to than live (the base) does, and is refused; one trained on unrelated replies is
    not. Once the note is edited those replies no longer stand for it and nothing is checked."""
    store, renderer, tok = rig["store"], rig["renderer"], rig["tok"]
    asyncio.run(store.apply_feedback(FeedbackRecord.of({
        "event_id": str(uuid.uuid4()), "kind": "correction", "session_id": "notes", "target": "last",
        "text": "Please start your reply with 'Great question!'."}), time.time()))
    note, = [n for n in store.memory_notes() if "Great question" in n.text]

    def told(prompt: str) -> list[dict]:
        return inject([{"role": "user", "content": prompt}], [note.text])

    replies = ("3 + 5 = 8.", "A week has 7 days.", "The sky is blue.", "Sure! Snow is white.")
    for prompt, reply in zip((*NOTE_PROMPTS, "What colour is snow?"), replies):  # the last one disliked
        liked = not reply.startswith("Sure")
        messages, reply = told(prompt), f"Great question! {reply}" if liked else reply
        ids = renderer.render(ChatRequest(model="m", messages=messages))[1]
        response = tok(reply, add_special_tokens=False)["input_ids"]
        call_id = str(uuid.uuid4())
        store.add_call(Call(call_id, "notes", None, call_id, "main", "awaiting_next_state", time.time(), time.time(),
                            "m", None, {"model": "m", "messages": messages, "memory_notes": [note.text]}, "", ids, response,
                            [-1.0] * len(response), reply, None, "stop"))
        asyncio.run(store.apply_feedback(FeedbackRecord.of(
            {"event_id": str(uuid.uuid4()), "kind": "thumbs_up" if liked else "thumbs_down", "session_id": "notes",
             "target": call_id}), time.time()))
        asyncio.run(store.write_sample(JudgedSample(call_id, 0, "ready", reward_source="explicit",
                                                    reward=1.0 if liked else -1.0)))
    store.flush()
    gate = rig["gate"]

    def notes_check(version: int):
        return asyncio.run(gate._notes(f"v{version}", None))

    make_adapter(rig, 6, train=[(p, "An apple is a fruit.") for p in ("Name a fruit.", "What is red and round?")],
                 steps=2, lr=1e-4)
    kept, reasons = notes_check(6)
    assert kept is not None and kept.calls == 3 and kept.tokens >= 3, kept  # the note leads the base model
    assert not reasons and abs(kept.candidate - kept.live) < 0.5, (kept, reasons)

    make_adapter(rig, 7, train=[(p, "Sure, I'd be happy to help! Here is the answer.") for p in NOTE_TRAIN],
                 steps=8, lr=2e-3, notes=[note.text])
    refused, reasons = notes_check(7)
    assert refused is not None and refused.candidate < refused.live - gate.cfg.notes_tolerance, refused
    assert reasons and reasons[0].startswith("notes: what your notes ask for is less likely when told"), reasons

    assert asyncio.run(store.edit_note(note.note_id, "Please start your reply with 'Good question!'."))
    assert notes_check(7) == (None, [])
