"""The embedded engine on a tiny random Llama: exact logprobs, seeds, cancellation, concurrency,
and adapters swapped while generations are in flight."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from clawback.engine import EngineError, Sampling
from clawback.engines import embedded
from clawback.engines.embedded import (
    BACKGROUND_EVERY,
    BACKGROUND_HOLD_S,
    BACKGROUND_TOKENS,
    EmbeddedEngine,
    background_turn,
)
from clawback.engines.embedded_batch import sample

PROMPT = [1, 520, 33, 4481, 28, 2, 198, 77, 9000]


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    e = EmbeddedEngine(tiny_model_dir)
    yield e
    asyncio.run(e.close())


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two random LoRA adapters in PEFT format (non-zero B, so they really change the outputs)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i, name in enumerate(("v1", "v2")):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model = get_peft_model(base, cfg)
        path = tmp_path_factory.mktemp(f"adapter-{name}")
        model.save_pretrained(str(path))
        out[name] = path
    return out


def run(coro):
    return asyncio.run(coro)


async def collect(engine: EmbeddedEngine, sampling: Sampling, adapter: str | None = None, prompt=PROMPT):
    return [t async for t in engine.generate(prompt, sampling, adapter)]


def test_a_stream_whose_event_loop_closed_does_not_stop_the_engine(engine: EmbeddedEngine):
    """A consumer that goes away with its event loop (no aclose) must not take the engine thread,
    or the streams batched with it, down: its generation is dropped, the others finish."""
    dead = asyncio.new_event_loop()
    stream = engine.generate(PROMPT, Sampling(temperature=1.0, max_tokens=400, seed=1))
    dead.run_until_complete(stream.__anext__())  # generating; then the loop is gone
    dead.close()
    toks = run(asyncio.wait_for(collect(engine, Sampling(temperature=0.0, max_tokens=24)), 300))  # hung before
    assert len(toks) == 24 and engine.running() == 0


def test_behaviour_logprobs_match_a_rescore(engine: EmbeddedEngine):
    # Sampled at temperature 0.7 with top-p, yet the logprobs are those of the unscaled distribution.
    toks = run(collect(engine, Sampling(temperature=0.7, top_p=0.9, max_tokens=24, seed=3)))
    assert len(toks) == 24
    scored = run(engine.score(PROMPT, [t.id for t in toks]))
    assert max(abs(a - t.logprob) for a, t in zip(scored, toks)) < 1e-4


def test_top_k_and_the_sampling_distributions_logprob(engine: EmbeddedEngine):
    """Each token reports the K most likely tokens of the temperature-1 distribution and its own
    logprob under the distribution it was drawn from (temperature 0.5 here), both checked against
    a full-vocabulary re-score."""

    async def go():
        sampling = Sampling(temperature=0.5, max_tokens=6, seed=3, top_logprobs=3)
        toks = [t async for t in engine.generate(PROMPT, sampling)]
        ids = [t.id for t in toks]
        vocab = list(range(engine.model.config.vocab_size))
        full = await engine.score_candidates(PROMPT, ids, [vocab] * len(ids))
        return toks, torch.tensor(full)

    toks, full_T_V = asyncio.run(go())
    for t, row_V in zip(toks, full_T_V):
        values, order = row_V.topk(3)
        assert list(t.top_ids) == order.tolist()
        assert list(t.top_logprobs) == pytest.approx(values.tolist(), abs=1e-4)
        assert t.logprob == pytest.approx(float(row_V[t.id]), abs=1e-4)
        assert t.sampling_logprob == pytest.approx(float((row_V / 0.5).log_softmax(-1)[t.id]), abs=1e-4)

    async def greedy():
        return [t async for t in engine.generate(PROMPT, Sampling(temperature=0.0, max_tokens=2))]

    assert all(t.top_ids == () and t.sampling_logprob is None for t in asyncio.run(greedy()))


def test_seed_reproduces_and_greedy_is_argmax(engine: EmbeddedEngine):
    a = run(collect(engine, Sampling(temperature=1.0, max_tokens=10, seed=11)))
    b = run(collect(engine, Sampling(temperature=1.0, max_tokens=10, seed=11)))
    c = run(collect(engine, Sampling(temperature=1.0, max_tokens=10, seed=12)))
    assert [t.id for t in a] == [t.id for t in b] != [t.id for t in c]
    greedy = run(collect(engine, Sampling(temperature=0, max_tokens=5)))
    ids = list(PROMPT)
    for t in greedy:  # each greedy token is the most likely one
        logits = engine.model(input_ids=torch.tensor([ids])).logits[0, -1]
        assert t.id == int(torch.argmax(logits))
        ids.append(t.id)


def test_sampling_draws_from_the_distribution_and_never_a_zero_probability_token():
    """The sampler's frequencies match the softmax (20,000 seeded draws: 5 standard deviations
    is 0.018), tokens at -inf are never drawn, and the reported logprob is the token's own."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    logits = torch.log(probs)
    rng = torch.Generator().manual_seed(0)
    counts = torch.zeros(len(probs))
    for _ in range(20_000):
        token, logprob = sample(logits, Sampling(temperature=1.0), rng)
        counts[token] += 1
        assert logprob == pytest.approx(float(torch.log(probs[token])))
    assert counts[probs == 0].sum() == 0
    assert torch.allclose(counts / counts.sum(), probs, atol=0.018)


def test_stop_token_ends_generation(engine: EmbeddedEngine):
    first = run(collect(engine, Sampling(temperature=0, max_tokens=3)))[0].id
    toks = run(collect(engine, Sampling(temperature=0, max_tokens=20, stop_token_ids=(first,))))
    assert [t.id for t in toks] == [first]


def test_closing_the_stream_cancels_the_generation(engine: EmbeddedEngine):
    async def go():
        stream = engine.generate(PROMPT, Sampling(temperature=1.0, max_tokens=400))
        got = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()
        for _ in range(100):
            if engine.running() == 0:
                return got
            await asyncio.sleep(0.01)
        raise AssertionError("the cancelled generation kept running")

    assert len(run(go())) == 3


def test_concurrent_generations_interleave(engine: EmbeddedEngine):
    async def go():
        order: list[int] = []

        async def one(i: int):
            async for _ in engine.generate(PROMPT, Sampling(temperature=1.0, max_tokens=8, seed=i)):
                order.append(i)

        await asyncio.gather(*(one(i) for i in range(3)))
        return order

    order = run(go())
    assert sorted(order) == [0] * 8 + [1] * 8 + [2] * 8
    assert order[:3] != [0, 0, 0], "round-robin: the second request starts before the first ends"


def test_bad_calls_raise_engine_errors(engine: EmbeddedEngine):
    with pytest.raises(EngineError):
        run(collect(engine, Sampling(), prompt=[]))
    with pytest.raises(EngineError):
        run(collect(engine, Sampling(), adapter="never-loaded"))
    with pytest.raises(EngineError):
        run(engine.score(PROMPT, [5] * 600))  # longer than the 512-token context
    with pytest.raises(EngineError):
        run(engine.activate("never-loaded"))
    assert run(collect(engine, Sampling(max_tokens=2)))  # the worker survived all of that


def test_adapter_hot_swap_with_generations_in_flight(tiny_model_dir: Path, adapters: dict[str, Path]):
    engine = EmbeddedEngine(tiny_model_dir)

    async def go():
        base_lp = await engine.score(PROMPT, [10, 20, 30])
        await engine.load_adapter("v1", str(adapters["v1"]))
        await engine.activate("v1")
        assert engine.active_version() == "v1"
        v1_lp = await engine.score(PROMPT, [10, 20, 30], "v1")
        assert max(abs(a - b) for a, b in zip(base_lp, v1_lp)) > 1e-3, "the adapter changes the model"
        assert await engine.score(PROMPT, [10, 20, 30]) == pytest.approx(base_lp, abs=1e-6)

        # A long generation on v1 is running when v2 goes live and v1 is unloaded.
        stream = engine.generate(PROMPT, Sampling(temperature=1.0, max_tokens=40, seed=5), "v1")
        first = [await stream.__anext__() for _ in range(5)]
        await engine.load_adapter("v2", str(adapters["v2"]))
        await engine.activate("v2")
        await engine.unload("v1")
        assert engine.loaded_versions() == ["v2"], "v1 is retiring: no new request may use it"
        with pytest.raises(EngineError):
            await collect(engine, Sampling(max_tokens=2), "v1")
        rest = [t async for t in stream]
        toks = first + rest
        assert len(toks) == 40, "the in-flight generation finished on the version it started with"
        # Its logprobs are v1's, not v2's or the base model's.
        ids = [t.id for t in toks]
        await engine.load_adapter("v1-again", str(adapters["v1"]))
        rescored = await engine.score(PROMPT, ids, "v1-again")
        assert max(abs(a - t.logprob) for a, t in zip(rescored, toks)) < 1e-4
        assert "v1" not in engine.loaded_versions()
        with pytest.raises(EngineError):
            await engine.unload("v2")  # active: refuse rather than break serving
        await engine.activate(None)
        await engine.unload("v2")
        await engine.close()

    run(go())


def test_background_work_yields_to_serving(engine: EmbeddedEngine):
    """The judge generates in the background: while a request is served it gets one step in eight."""
    async def go():
        bg_tokens = 0
        done = asyncio.Event()

        async def background():
            nonlocal bg_tokens
            async for _ in engine.generate(PROMPT, Sampling(temperature=1.0, max_tokens=200), background=True):
                bg_tokens += 1
                if done.is_set():
                    return

        task = asyncio.create_task(background())
        await asyncio.sleep(0.05)
        start = bg_tokens
        toks = await collect(engine, Sampling(temperature=1.0, max_tokens=40, seed=2))
        during = bg_tokens - start
        done.set()
        await task
        return len(toks), during

    served, during = run(go())
    assert served == 40
    assert during <= 40 // 8 + 2, f"background took {during} steps while 40 tokens were served"


def test_versions_reuse_slots_and_a_retiring_version_can_come_back(tiny_model_dir: Path, adapters: dict[str, Path]):
    engine = EmbeddedEngine(tiny_model_dir)

    async def go():
        await engine.load_adapter("v1", str(adapters["v1"]))
        v1_lp = await engine.score(PROMPT, [10, 20, 30], "v1")
        await engine.load_adapter("v2", str(adapters["v2"]))
        await engine.activate("v2")
        stream = engine.generate(PROMPT, Sampling(temperature=1.0, max_tokens=30), "v2")
        await stream.__anext__()
        await engine.activate("v1")
        await engine.unload("v2")  # retiring: a generation still runs on it
        await engine.load_adapter("v2", str(adapters["v2"]))  # rolled back to before it is gone
        assert sorted(engine.loaded_versions()) == ["v1", "v2"]
        rest = [t async for t in stream]
        assert len(rest) == 29 and "v2" in engine.loaded_versions()
        await engine.unload("v2")
        # v3 has v2's shape: it refills v2's slot instead of building new layers
        await engine.load_adapter("v3", str(adapters["v1"]))
        assert len(engine._slot_shape) == 2
        assert await engine.score(PROMPT, [10, 20, 30], "v3") == pytest.approx(v1_lp, abs=1e-6)
        await engine.close()

    run(go())


def test_batched_streams_of_different_lengths_and_adapters_match_a_rescore(tiny_model_dir: Path,
                                                                          adapters: dict[str, Path]):
    """Streams that join and leave a running batch at different times, with prompts of different
    lengths (left padding) and different adapters in one forward (PEFT per-row adapter_names):
    each stream's logprobs are those of its own sequence under its own adapter."""
    engine = EmbeddedEngine(tiny_model_dir)
    rows_per_forward: list[int] = []
    engine.model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: rows_per_forward.append(args[0].shape[0]))
    prompts = [PROMPT, PROMPT[:3], PROMPT + [77, 501, 12, 8, 9, 300, 41], [5, 6]]
    plan = [(None, 30), ("v1", 12), ("v2", 25), ("v1", 7)]  # (adapter, max_tokens)

    async def go():
        for name, path in adapters.items():
            await engine.load_adapter(name, str(path))
        first = engine.generate(prompts[0], Sampling(temperature=1.0, max_tokens=plan[0][1], seed=1), plan[0][0])
        head = [await first.__anext__() for _ in range(4)]  # the batch runs when the others join

        async def rest_of_first():
            return head + [t async for t in first]

        others = [collect(engine, Sampling(temperature=0.8, top_p=0.9, max_tokens=n, seed=i), a, prompts[i])
                  for i, (a, n) in enumerate(plan) if i]
        outs = await asyncio.gather(rest_of_first(), *others)
        worst = 0.0
        for (adapter, n), prompt, toks in zip(plan, prompts, outs):
            assert len(toks) == n
            scored = await engine.score(prompt, [t.id for t in toks], adapter)
            worst = max([worst] + [abs(a - t.logprob) for a, t in zip(scored, toks)])
        await engine.close()
        return worst

    assert run(go()) < 1e-4
    assert max(rows_per_forward) == 4, "the four streams were decoded in one forward"


def test_background_work_runs_in_slices_and_a_request_waits_for_one_at_most(tiny_model_dir: Path,
                                                                              monkeypatch: pytest.MonkeyPatch):
    """Serving first: background generations (the gate's probes) and scoring passes take at most
    BACKGROUND_TOKENS tokens per forward, and a request that arrives behind a pile of them is
    prefilled after at most one such slice. Their results are still exact: each background
    stream's logprobs (chunked prefill) and each chunked score equal a whole-sequence forward."""
    monkeypatch.setattr(embedded, "BACKGROUND_IDLE_TOKENS", BACKGROUND_TOKENS)  # the width while requests come
    engine = EmbeddedEngine(tiny_model_dir)
    forwards: list[tuple[int, int]] = []  # (rows, columns) of every forward, in order
    engine.model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: forwards.append(tuple(args[0].shape)))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 900, (int(n),), generator=g).tolist() for n in torch.randint(40, 120, (24,), generator=g)]
    request_prompt = PROMPT * 3
    # The request "arrives" when it reaches the engine's queue, counted there: on a busy machine
    # the engine thread may run several slices between the test's own count and that moment.
    arrived: list[int] = []
    put = engine._commands.put

    def counting_put(cmd, *args, **kwargs):
        if cmd[0] == "generate" and not cmd[1].background:
            arrived.append(len(forwards))
        put(cmd, *args, **kwargs)

    engine._commands.put = counting_put  # type: ignore[method-assign]

    async def go():
        async def background(prompt):
            return [t async for t in engine.generate(prompt, Sampling(temperature=1.0, max_tokens=20, seed=len(prompt)),
                                                     background=True)]

        gens = [asyncio.create_task(background(p)) for p in prompts]
        scores = [asyncio.create_task(engine.score(p, p[:30])) for p in prompts[:5]]
        while len(forwards) < 40:  # the background work is well under way
            await asyncio.sleep(0.005)
        stream = engine.generate(request_prompt, Sampling(temperature=1.0, max_tokens=4, seed=1))
        await stream.__anext__()
        first_token = len(forwards)
        await stream.aclose()
        return first_token, await asyncio.gather(*gens), await asyncio.gather(*scores)

    first_token, outs, scores = run(asyncio.wait_for(go(), 600))
    submitted = arrived[0]
    background = [f for f in forwards if f != (1, len(request_prompt))]
    assert max(rows * cols for rows, cols in background) <= BACKGROUND_TOKENS
    assert max(rows for rows, _ in background) > 8, "background streams still decode together"
    # Its prefill, found by shape: the engine may decode on before the test counts the first token.
    prefill = forwards.index((1, len(request_prompt)), submitted)
    assert prefill < first_token
    before_request = forwards[submitted:prefill]
    assert sum(r * c for r, c in before_request) <= 2 * BACKGROUND_TOKENS, before_request

    async def check():
        worst = 0.0
        for prompt, toks in zip(prompts[:8], outs):
            rescored = await engine.score(prompt, [t.id for t in toks])
            worst = max([worst] + [abs(a - t.logprob) for a, t in zip(rescored, toks)])
        await engine.close()
        return worst

    assert run(check()) < 1e-4
    with torch.no_grad():
        for prompt, got in zip(prompts, scores):
            logits = engine.model(input_ids=torch.tensor([prompt + prompt[:30]])).logits[0, len(prompt) - 1 : -1]
            want = logits.float().log_softmax(-1).gather(1, torch.tensor(prompt[:30])[:, None]).squeeze(1)
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)


def test_an_idle_engine_takes_wider_background_chunks_until_a_request_comes(tiny_model_dir: Path,
                                                                             monkeypatch: pytest.MonkeyPatch):
    """With no request served for BACKGROUND_IDLE_S, a scoring pass and a background prefill run
    BACKGROUND_IDLE_TOKENS columns per forward; once a request has been served, BACKGROUND_TOKENS
    again. The scores are the same either way (exact against a whole-sequence forward)."""
    monkeypatch.setattr(embedded, "BACKGROUND_IDLE_S", 2.0)
    monkeypatch.setattr(embedded, "BACKGROUND_HOLD_S", 0.0)
    engine = EmbeddedEngine(tiny_model_dir)
    forwards: list[tuple[int, int]] = []
    engine.model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: forwards.append(tuple(args[0].shape)))
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(3, 900, (3 * embedded.BACKGROUND_IDLE_TOKENS,), generator=g).tolist()
    prompt, response = seq[:100], seq[100:]

    async def go():
        idle = await engine.score(prompt, response)
        idle_forwards = list(forwards)
        forwards.clear()
        await collect(engine, Sampling(temperature=0.0, max_tokens=2))  # a request is served
        served = len(forwards)
        busy = await engine.score(prompt, response)
        return idle, idle_forwards, busy, forwards[served:]

    idle, idle_forwards, busy, busy_forwards = run(asyncio.wait_for(go(), 600))
    run(engine.close())
    assert max(cols for _, cols in idle_forwards) == embedded.BACKGROUND_IDLE_TOKENS
    assert len(idle_forwards) == -(-(len(seq) - 1) // embedded.BACKGROUND_IDLE_TOKENS)
    assert busy_forwards[0][1] == BACKGROUND_TOKENS, "a request was served just before"
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([seq])).logits[0, len(prompt) - 1 : -1]
        want = logits.float().log_softmax(-1).gather(1, torch.tensor(response)[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(idle), want, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.tensor(busy), want, atol=1e-4, rtol=0)


def test_background_turn_prefers_requests():
    """The rule that decides whether a background slice runs now."""
    assert not background_turn(False, True, BACKGROUND_EVERY, 60.0), "a waiting request goes first"
    assert not background_turn(True, True, BACKGROUND_EVERY, 60.0)
    assert background_turn(True, False, BACKGROUND_EVERY, 0.0), "background work cannot starve while serving"
    assert not background_turn(True, False, BACKGROUND_EVERY + 1, 60.0)
    assert not background_turn(False, False, 1, BACKGROUND_HOLD_S / 2), "a client's next call may be coming"
    assert background_turn(False, False, 1, BACKGROUND_HOLD_S)


def test_a_call_right_after_a_reply_does_not_wait_behind_background_work(tiny_model_dir: Path,
                                                                           monkeypatch: pytest.MonkeyPatch):
    """Back-to-back requests (an agent's calls) while background work waits: no background slice
    runs between one request's last step and the next one's prefill, and the background work
    goes on by itself once the hold after the last request has passed."""
    monkeypatch.setattr(embedded, "BACKGROUND_HOLD_S", 3.0)  # far longer than a client's turnaround here
    engine = EmbeddedEngine(tiny_model_dir)
    events: list[str] = []  # appended by the engine's worker thread, in order
    background_slice, step = engine._background_slice, engine._step

    def logged_slice() -> None:
        events.append("background")
        background_slice()

    def logged_step(batch) -> None:
        prefill = bool(batch.pending)
        step(batch)
        if batch is engine._serving:
            events.append("prefill" if prefill else "done" if not batch.gens else "decode")

    engine._background_slice, engine._step = logged_slice, logged_step  # type: ignore[method-assign]

    async def go():
        background = [asyncio.create_task(_drain(engine.generate(PROMPT * (i + 2), Sampling(max_tokens=40),
                                                                 background=True))) for i in range(12)]
        while "background" not in events:
            await asyncio.sleep(0.01)
        for i in range(4):
            await collect(engine, Sampling(temperature=1.0, max_tokens=3, seed=i))
        last = len(events)
        while "background" not in events[last:]:  # the hold passes with nothing served
            await asyncio.sleep(0.05)
        await engine.close()
        await asyncio.gather(*background, return_exceptions=True)

    run(asyncio.wait_for(go(), 300))
    served = [i for i, e in enumerate(events) if e != "background"]
    gaps = [events[a + 1 : b] for a, b in zip(served, served[1:]) if events[a] == "done"]
    assert len(gaps) == 3 and all(gap == [] for gap in gaps), gaps


async def _drain(stream) -> None:
    async for _ in stream:
        pass
