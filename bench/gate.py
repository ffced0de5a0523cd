"""What the candidate gate costs per version on the embedded model, next to the training step.

One run, interleaved: the base model's probe pass (once per daemon run; cached), then for each of
`--candidates` real adapters (one Binary RL step each, different seeds, lr 1e-4): the training
step that made it and the gate's review of it (probe pass + replay of the held-out calls). The
review sits between "version loaded" and "version live", so its time is what the gate adds to
the feedback → live path; the ratio to the step time is the number that carries to other
machines. Medians over candidates. Results: bench/README.md ("Gate").

    nice -n 10 python bench/gate.py --candidates 3 --out bench/results/gate.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

HELD_OUT_PROMPTS = ("Write a haiku about rain.", "How do I make tea?", "Name three fruits.", "What is a verb?",
                    "Give me a tip for studying.", "Why is the sky blue?", "What is 12 times 3?", "Say hello in French.",
                    "Describe a cat in one sentence.", "What is the capital of Spain?", "How many legs has a dog?",
                    "Suggest a name for a goldfish.", "What is photosynthesis?", "Tell me a fun fact.",
                    "What day comes after Monday?", "How do I say thanks politely?")


async def main(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from clawback.adapter_format import publish
    from clawback.chat import ChatRenderer, ChatRequest
    from clawback.daemon.config import EMBEDDED_MODEL, GateConfig
    from clawback.daemon.gate import CandidateGate
    from clawback.daemon.models import CATALOGUE, pull
    from clawback.daemon.store import Store
    from clawback.engine import Sampling
    from clawback.engines.embedded import EmbeddedEngine
    from clawback.records import Call, FeedbackRecord, JudgedSample, StepRecord
    from clawback.trainer.config import TrainConfig
    from clawback.trainer.step import Sample, make_lora_model, make_optimizer, train_step

    torch.set_num_threads(args.threads)
    model_dir = pull(CATALOGUE[EMBEDDED_MODEL], Path.home() / ".cache" / "clawback" / "models")
    tmp = Path(tempfile.mkdtemp(prefix="bench-gate-"))
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    renderer = ChatRenderer(tok)
    engine = EmbeddedEngine(model_dir, device="cpu", torch_threads=args.threads)
    store = Store(tmp / "db.sqlite")
    gate = CandidateGate(engine, renderer, store, GateConfig(probes=args.probes))
    eos = engine.info.eos_token_ids

    # Held-out rated calls: the base model's own replies, alternately liked and disliked.
    held: list[Sample] = []
    for i, prompt in enumerate(HELD_OUT_PROMPTS):
        ids = renderer.render(ChatRequest(model="m", messages=[{"role": "user", "content": prompt}]))[1]
        out = [t async for t in engine.generate(ids, Sampling(temperature=0.0, max_tokens=48, stop_token_ids=eos))]
        response = [t.id for t in out]
        call_id = str(uuid.uuid4())
        store.add_call(Call(call_id, "bench", None, call_id, "main", "awaiting_next_state", time.time(), time.time(),
                            "m", None, {"messages": [{"role": "user", "content": prompt}]}, "", ids, response,
                            [t.logprob for t in out], tok.decode(response), None, "stop"))
        kind = "thumbs_up" if i % 2 == 0 else "thumbs_down"
        await store.apply_feedback(FeedbackRecord.of({"event_id": str(uuid.uuid4()), "kind": kind, "session_id": "bench",
                                    "target": call_id}), time.time())
        await store.write_sample(JudgedSample(call_id, 0, "dropped", reason="held_out", reward_source="explicit",
                                              reward=1.0 if i % 2 == 0 else -1.0))
        held.append(Sample(prompt_ids=ids, response_ids=response, behaviour_logprobs=[t.logprob for t in out],
                           reward=1.0 if i % 2 == 0 else -1.0))

    t0 = time.perf_counter()
    base = await gate._probe(None)
    result: dict = {"probes": len(gate.probes), "held_out_calls": len(held), "threads": args.threads,
                    "base_probe_pass_s": round(time.perf_counter() - t0, 2), "base_score": base["score"],
                    "base_stats": base["stats"], "candidates": []}
    print(json.dumps({k: v for k, v in result.items() if k != "candidates"}), flush=True)
    for k in range(1, args.candidates + 1):
        cfg = TrainConfig(method="binary", lr=1e-4, seed=k, batch_size=len(held))
        model = make_lora_model(AutoModelForCausalLM.from_pretrained(str(model_dir)), cfg)
        opt = make_optimizer(model, cfg)
        t0 = time.perf_counter()
        metrics = train_step(model, opt, held, cfg)
        step_s = time.perf_counter() - t0
        path = publish(tmp / "adapters", k, model, opt, {"method": "binary"})
        del model, opt
        await store.record_step(StepRecord(k, None, time.time(), "binary", (), "committed", candidate=True,
                                           path=str(path)))
        await engine.load_adapter(f"v{k}", str(path))
        verdict = await gate.review(k, None, metrics)
        await engine.unload(f"v{k}")
        row = {"version": k, "train_step_s": round(step_s, 2), "review_s": verdict.report["seconds"],
               "promoted": verdict.promote, "reasons": verdict.reasons,
               "retention": verdict.report.get("retention"), "replay": verdict.report.get("replay")}
        result["candidates"].append(row)
        print(json.dumps(row), flush=True)
    reviews = [c["review_s"] for c in result["candidates"]]
    steps = [c["train_step_s"] for c in result["candidates"]]
    result["median_review_s"] = statistics.median(reviews)
    result["median_train_step_s"] = statistics.median(steps)
    result["review_over_step"] = statistics.median(r / s for r, s in zip(reviews, steps))
    await engine.close()
    store.close()
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--candidates", type=int, default=3)
    p.add_argument("--probes", type=int, default=0, help="0 = the whole probe set")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="bench/results/gate.json")
    args = p.parse_args()
    out = asyncio.run(main(args))
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("median_review_s", "median_train_step_s", "review_over_step")}))
