"""The training step end to end on a tiny random Llama: batching is exact, and Binary RL and OPD
move the policy the way their signals say."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from clawback.trainer.config import MICRO_BATCH_TOKENS, TrainConfig
from clawback.trainer.step import (
    Sample,
    collate,
    make_lora_model,
    make_optimizer,
    micro_batches,
    response_logprobs,
    train_step,
    with_evidence,
)

V, PROMPT_LEN, RESPONSE_LEN, N = 64, 4, 8, 32
TARGET = 7



def tiny_policy(cfg: TrainConfig):
    # initializer_range 0.2 rather than HF's 0.02: with near-zero embeddings the (tied, not
    # adapted) lm_head cannot express a confident token whatever LoRA does to the hidden states.
    config = LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = make_lora_model(LlamaForCausalLM(config), cfg).eval()
    return model, make_optimizer(model, cfg)


def prompts() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(8, V, (N, PROMPT_LEN), generator=g)


@torch.no_grad()
def sample(model, prompts_B_P: torch.Tensor, g: torch.Generator):
    """Sample at temperature 1 with plain torch; return response ids and their logprobs."""
    ids = prompts_B_P.clone()
    logps = []
    for _ in range(RESPONSE_LEN):
        logp_B_V = model(input_ids=ids).logits[:, -1].float().log_softmax(-1)
        tok_B_1 = torch.multinomial(logp_B_V.exp(), 1, generator=g)
        logps.append(logp_B_V.gather(-1, tok_B_1))
        ids = torch.cat([ids, tok_B_1], dim=1)
    return ids[:, PROMPT_LEN:], torch.cat(logps, dim=1)


@torch.no_grad()
def first_token_logp(model, prompts_B_P: torch.Tensor, token: int) -> float:
    return float(model(input_ids=prompts_B_P).logits[:, -1].float().log_softmax(-1)[:, token].mean())


def random_samples(n: int, seed: int, teacher: bool = False) -> list[Sample]:
    """Mixed prompt and response lengths, so the padding layout is exercised."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        P, R = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 7, (1,), generator=g))
        out.append(Sample(
            prompt_ids=torch.randint(0, V, (P,), generator=g).tolist(),
            response_ids=torch.randint(0, V, (R,), generator=g).tolist(),
            behaviour_logprobs=(-4 + torch.randn(R, generator=g)).tolist(),
            reward=float(torch.randint(-1, 2, (1,), generator=g)),
            teacher_logprobs=(-4 + torch.randn(R, generator=g)).tolist() if teacher else None,
        ))
    return out


def test_batched_logprobs_equal_one_sample_at_a_time():
    model, _ = tiny_policy(TrainConfig(lora_rank=4, lora_alpha=8))
    samples = random_samples(6, seed=1)
    batch = collate(samples, torch.device("cpu"))
    with torch.no_grad():
        logp_B_T, ent_B_T, _ = response_logprobs(model, batch)
        for i, s in enumerate(samples):
            P, R = len(s.prompt_ids), len(s.response_ids)
            logits = model(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0, P - 1 : P - 1 + R]
            full = logits.float().log_softmax(-1)
            want = full.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(logp_B_T[i, :R], want, atol=1e-5, rtol=0)
            torch.testing.assert_close(ent_B_T[i, :R], -(full.exp() * full).sum(-1), atol=1e-5, rtol=0)
            assert batch["mask_B_T"][i].sum() == R


def test_chunked_head_gives_the_logprobs_and_gradients_of_full_logits():
    """response_logprobs runs the output head over a few positions at a time; its log-probs,
    top-K log-probs, entropy and LoRA gradients are those of the whole micro-batch's logits."""
    model, _ = tiny_policy(TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2))
    with torch.no_grad():  # non-zero LoRA B, so every LoRA weight gets a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    g = torch.Generator().manual_seed(7)
    samples = [replace(s, top_ids=torch.randint(0, V, (len(s.response_ids), 3), generator=g).tolist(),
                       top_logprobs=[[-1.0] * 3] * len(s.response_ids),
                       teacher_top_logprobs=[[-1.0] * 3] * len(s.response_ids))
               for s in random_samples(6, seed=7)]
    batch = collate(samples, torch.device("cpu"), top_k=3)
    weight_B_T = torch.randn(batch["target_B_T"].shape, generator=g) * batch["mask_B_T"]

    def full_logits():
        T = batch["target_B_T"].shape[1]
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"], logits_to_keep=T + 1).logits[:, :-1].float()
        logp = logits.log_softmax(-1)
        return (logp.gather(-1, batch["target_B_T"][..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1),
                logp.gather(-1, batch["top_ids_B_T_K"]))

    results = []
    for compute in (full_logits, lambda: response_logprobs(model, batch, entropy_grad=True, top_k=True, chunk_tokens=5)):
        model.zero_grad()
        logp, ent, top = compute()
        ((logp + 0.1 * ent + 0.3 * top.sum(-1)) * weight_B_T).sum().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
        results.append((logp.detach(), ent.detach(), top.detach(), grads))
    (*want, want_grads), (*got, got_grads) = results
    for w, x in zip(want, got):
        torch.testing.assert_close(x, w, atol=1e-5, rtol=1e-5)
    assert sum(float(v.abs().sum()) for v in want_grads.values()) > 0
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], atol=1e-6, rtol=1e-4)


def test_micro_batches_respect_the_token_budget():
    samples = random_samples(20, seed=2)
    groups = micro_batches(samples, token_budget=24)
    assert sorted(map(id, sum(groups, []))) == sorted(map(id, samples))
    for g in groups:
        padded = len(g) * (max(len(s.prompt_ids) for s in g) + max(len(s.response_ids) for s in g))
        assert padded <= 24 or len(g) == 1
    assert len(micro_batches(samples, token_budget=10**6)) == 1


def test_gradient_accumulation_equals_one_big_batch():
    samples = random_samples(10, seed=3, teacher=True)
    results = []
    for budget in (10**6, 16):  # one micro-batch vs many
        cfg = TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2, micro_batch_tokens=budget, entropy_coef=0.01)
        model, opt = tiny_policy(cfg)
        # Two steps: the second starts from non-zero LoRA B, so every LoRA weight gets a gradient.
        metrics = [train_step(model, opt, samples, cfg) for _ in range(2)]
        results.append((metrics, {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}))
    (m_one, w_one), (m_many, w_many) = results
    assert m_one[0]["micro_batches"] == 1 and m_many[0]["micro_batches"] > 3
    for k in w_one:
        torch.testing.assert_close(w_one[k], w_many[k], atol=1e-6, rtol=1e-5)
    for key in ("loss", "adv", "entropy", "drift", "grad_norm"):
        assert m_one[1][key] == pytest.approx(m_many[1][key], rel=1e-4, abs=1e-6), key


def test_gradient_checkpointing_gives_the_same_update():
    samples = random_samples(6, seed=4, teacher=True)
    weights = []
    for checkpointing in (False, True):
        cfg = TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2, gradient_checkpointing=checkpointing)
        model, opt = tiny_policy(cfg)
        base = model.base_model.model
        assert base.is_activation_checkpointing == checkpointing
        for _ in range(2):
            train_step(model, opt, samples, cfg)
        weights.append({k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad})
    for k in weights[0]:
        torch.testing.assert_close(weights[0][k], weights[1][k], atol=1e-6, rtol=1e-5)


def test_binary_rl_raises_the_rewarded_token():
    cfg = TrainConfig(method="binary", lora_rank=8, lora_alpha=16, lr=2e-2)
    model, opt = tiny_policy(cfg)
    P = prompts()
    g = torch.Generator().manual_seed(0)
    start = first_token_logp(model, P, TARGET)
    for step in range(12):
        resp_B_R, logp_B_R = sample(model, P, g)
        samples = [
            Sample(P[i].tolist(), resp_B_R[i].tolist(), logp_B_R[i].tolist(), 1.0 if TARGET in resp_B_R[i] else -1.0)
            for i in range(N)
        ]
        m = train_step(model, opt, samples, cfg)
        # On-policy samples: the trainer's logprobs must reproduce the sampler's, token by token.
        assert m["drift"] < 1e-4 and m["tis"] == pytest.approx(1.0, abs=1e-3)
    end = first_token_logp(model, P, TARGET)
    # Measured over 6 sampling seeds: +3.4 to +4.1 nats after 12 steps.
    assert end > start + 1.5, (start, end)


def test_opd_moves_the_student_towards_the_teacher():
    cfg = TrainConfig(method="opd", lora_rank=8, lora_alpha=16, lr=1e-2)
    model, opt = tiny_policy(cfg)
    teacher = copy.deepcopy(model)  # frozen: the starting policy with a bias towards TARGET
    bias_V = torch.zeros(V)
    bias_V[TARGET] = 3.0
    P = prompts()
    g = torch.Generator().manual_seed(0)
    start = first_token_logp(model, P, TARGET)
    for step in range(16):
        resp_B_R, logp_B_R = sample(model, P, g)
        with torch.no_grad():
            ids = torch.cat([P, resp_B_R], dim=1)
            t_logits = teacher(input_ids=ids).logits[:, PROMPT_LEN - 1 : -1].float() + bias_V
            t_logp_B_R = t_logits.log_softmax(-1).gather(-1, resp_B_R[..., None]).squeeze(-1)
        samples = [
            Sample(P[i].tolist(), resp_B_R[i].tolist(), logp_B_R[i].tolist(), 0.0, t_logp_B_R[i].tolist())
            for i in range(N)
        ]
        train_step(model, opt, samples, cfg)
    end = first_token_logp(model, P, TARGET)
    # The teacher sits ~2.8 nats above the start; measured over 6 sampling seeds: +1.4 to +1.8.
    assert end > start + 0.8, (start, end)


def test_several_updates_per_batch_move_further_and_the_clip_bounds_them():
    """updates_per_batch > 1 takes that many AdamW steps on one batch against the policy before
    the first. At a small lr the rewarded token rises further than with one update; from the second
    update on the ratio leaves 1 and the clip removes the gradient of tokens that have moved
    enough (on the sampled token and on each top-K token), so at a large lr, where one update
    already moves the token past the clip, eight updates add little."""
    P = prompts()
    moved, metrics = {}, {}
    for lr, updates in ((1e-3, 1), (1e-3, 4), (1e-2, 1), (1e-2, 8)):
        cfg = TrainConfig(method="combined", lora_rank=8, lora_alpha=16, lr=lr, updates_per_batch=updates)
        model, opt = tiny_policy(cfg)
        with torch.no_grad():
            logp_B_V = model(input_ids=P).logits[:, -1].float().log_softmax(-1)
        top_B_K, ids_B_K = logp_B_V.topk(4)
        lp = logp_B_V[:, TARGET]
        samples = [Sample(P[i].tolist(), [TARGET], [float(lp[i])], 1.0, [float(lp[i])],
                          top_ids=[ids_B_K[i].tolist()], top_logprobs=[top_B_K[i].tolist()],
                          teacher_top_logprobs=[(top_B_K[i] + 0.5).tolist()]) for i in range(N)]
        metrics[lr, updates] = m = train_step(model, opt, samples, cfg)
        moved[lr, updates] = first_token_logp(model, P, TARGET) - float(lp.mean())
        assert m["updates"] == updates
        if updates == 1:
            assert m["clip_frac"] == 0.0 and m["ratio"] == pytest.approx(1.0)
        else:
            assert m["clip_high"] > 0.2 and m["ratio"] > 1.1, m
    # Measured: 0.11 -> 0.43 nats at lr 1e-3; 1.02 -> 1.13 at lr 1e-2.
    assert moved[1e-3, 4] > 2 * moved[1e-3, 1] > 0, moved
    assert moved[1e-2, 8] < moved[1e-2, 1] + 0.4, moved


def test_a_later_update_with_a_non_finite_gradient_ends_the_step_and_keeps_the_earlier_ones():
    samples = random_samples(4, seed=6)
    weights = {}
    for updates in (1, 3):
        cfg = TrainConfig(method="binary", lora_rank=4, lora_alpha=8, lr=1e-2, updates_per_batch=updates)
        model, opt = tiny_policy(cfg)
        forwards: list[int] = []
        param = next(p for p in model.parameters() if p.requires_grad)
        # From the second pass over the batch on, this parameter's gradient is NaN.
        param.register_hook(lambda grad: grad * float("nan") if len(forwards) > 1 else grad)
        m = train_step(model, opt, samples, cfg, before_micro_batch=lambda: forwards.append(1))
        assert m["updates"] == 1 and len(forwards) == min(updates, 2)
        weights[updates] = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    for k, v in weights[1].items():
        assert torch.isfinite(v).all()
        torch.testing.assert_close(weights[3][k], v)


def test_kl_is_measured_against_the_base_model():
    cfg = TrainConfig(method="binary", lora_rank=4, lora_alpha=8, lr=5e-2, kl_coef=0.1)
    model, opt = tiny_policy(cfg)
    samples = random_samples(8, seed=4)
    kls = [train_step(model, opt, samples, cfg)["kl"] for _ in range(3)]
    assert kls[0] < 1e-7  # LoRA B starts at 0: the adapter is the base model
    assert kls[2] > 1e-4  # after two updates the adapted policy has moved away from the base


def test_topk_opd_raises_a_token_the_student_did_not_sample():
    """The teacher prefers each prompt's 4th most likely first token, which the student did not
    sample (it sampled its top token, which the teacher rates as the student does). Token-level
    OPD then has no signal at all; top-K OPD raises the wanted token."""
    P = prompts()
    moved = {}
    for top_k in (4, 0):
        cfg = TrainConfig(method="opd", lora_rank=8, lora_alpha=16, lr=1e-2, opd_top_k=top_k)
        model, opt = tiny_policy(cfg)
        with torch.no_grad():
            logp_B_V = model(input_ids=P).logits[:, -1].float().log_softmax(-1)
        top_B_K, ids_B_K = logp_B_V.topk(4)
        wanted_B = ids_B_K[:, 3]
        teacher_B_K = top_B_K + torch.tensor([0.0, 0.0, 0.0, 2.0])
        samples = [Sample(P[i].tolist(), [int(ids_B_K[i, 0])], [float(top_B_K[i, 0])], 0.0, [float(top_B_K[i, 0])],
                          top_ids=[ids_B_K[i].tolist()], top_logprobs=[top_B_K[i].tolist()],
                          teacher_top_logprobs=[teacher_B_K[i].tolist()]) for i in range(N)]
        start = logp_B_V.gather(-1, wanted_B[:, None]).mean()
        for _ in range(5):
            m = train_step(model, opt, samples, cfg)
        with torch.no_grad():
            end = model(input_ids=P).logits[:, -1].float().log_softmax(-1).gather(-1, wanted_B[:, None]).mean()
        moved[top_k] = float(end - start)
        assert ("topk_adv" in m) == bool(top_k)
    assert moved[4] > 0.5 and abs(moved[0]) < 1e-3, moved


def test_top_k_stops_where_the_reply_left_the_teachers_path():
    """Each reply's first token is one the teacher puts 3 nats below the student (the reply did not
    do what the hint asks); at the second, the teacher prefers the student's 4th token, as a
    teacher repairing a prefix it would not have written does. With `topk_until_nats` the top-K
    term covers the first position only, so the second position's wanted token is not raised, and
    the second position trains on its sampled token."""
    P = prompts()
    moved = {}
    for until in (None, 1.0):
        cfg = TrainConfig(method="opd", lora_rank=8, lora_alpha=16, lr=1e-2, opd_top_k=4, topk_until_nats=until)
        model, opt = tiny_policy(cfg)
        with torch.no_grad():
            first_B_V = model(input_ids=P).logits[:, -1].float().log_softmax(-1)
            first_B = first_B_V.argmax(-1)
            second_B_V = model(input_ids=torch.cat([P, first_B[:, None]], 1)).logits[:, -1].float().log_softmax(-1)
        top0_B_K, ids0_B_K = first_B_V.topk(4)
        top1_B_K, ids1_B_K = second_B_V.topk(4)
        wanted_B = ids1_B_K[:, 3]
        teacher0_B_K = top0_B_K - 3.0
        teacher1_B_K = top1_B_K + torch.tensor([0.0, 0.0, 0.0, 2.0])
        samples = [Sample(P[i].tolist(), [int(ids0_B_K[i, 0]), int(ids1_B_K[i, 0])],
                          [float(top0_B_K[i, 0]), float(top1_B_K[i, 0])], 0.0,
                          [float(teacher0_B_K[i, 0]), float(top1_B_K[i, 0]) - 0.5],
                          top_ids=[ids0_B_K[i].tolist(), ids1_B_K[i].tolist()],
                          top_logprobs=[top0_B_K[i].tolist(), top1_B_K[i].tolist()],
                          teacher_top_logprobs=[teacher0_B_K[i].tolist(), teacher1_B_K[i].tolist()])
                   for i in range(N)]
        batch = collate(samples[:1], torch.device("cpu"), top_k=4, topk_until_nats=until)
        assert batch["topk_B_T"].tolist() == [[1.0, 1.0] if until is None else [1.0, 0.0]]
        # where top-K covers a position its sampled-token term is 0 (teacher = behaviour)
        sampled_gap = float(batch["teacher_B_T"][0, 1] - batch["behaviour_B_T"][0, 1])
        assert sampled_gap == pytest.approx(0.0 if until is None else -0.5)
        start = second_B_V.gather(-1, wanted_B[:, None]).mean()
        for _ in range(5):
            train_step(model, opt, samples, cfg)
        with torch.no_grad():
            end = model(input_ids=torch.cat([P, first_B[:, None]], 1)).logits[:, -1].float().log_softmax(-1)
        moved[until] = float(end.gather(-1, wanted_B[:, None]).mean() - start)
    assert moved[None] > 0.5 and moved[1.0] < 0.1, moved


def test_a_corrections_penalty_falls_up_to_where_the_reply_left_the_hint():
    """A corrected reply (−1, with its hint's teacher): the teacher puts its first token 3 nats
    below the policy and agrees with its second. With `penalty_until_nats` the −1 falls on the
    first token only, and the second (what followed a wrong opener: the working, the answer)
    falls less than half as far as with the −1 on every token (the shared weights still move it). A liked reply's reward and a 👎 without a
    teacher still cover every token."""
    P = prompts()
    with torch.no_grad():
        model, _ = tiny_policy(TrainConfig())
        first_B_V = model(input_ids=P).logits[:, -1].float().log_softmax(-1)
        first_B = first_B_V.argmax(-1)
        second_B_V = model(input_ids=torch.cat([P, first_B[:, None]], 1)).logits[:, -1].float().log_softmax(-1)
        second_B = second_B_V.argmax(-1)
    lp0_B, lp1_B = first_B_V.gather(-1, first_B[:, None])[:, 0], second_B_V.gather(-1, second_B[:, None])[:, 0]
    samples = [Sample(P[i].tolist(), [int(first_B[i]), int(second_B[i])], [float(lp0_B[i]), float(lp1_B[i])], -1.0,
                      [float(lp0_B[i]) - 3.0, float(lp1_B[i])]) for i in range(N)]
    liked = replace(samples[0], reward=1.0)
    untaught = replace(samples[0], teacher_logprobs=None)
    batch = collate([samples[0], liked, untaught], torch.device("cpu"), penalty_until_nats=1.0)
    assert batch["reward_B_T"].tolist() == [[-1.0, 0.0], [1.0, 1.0], [-1.0, -1.0]]
    moved = {}
    for until in (None, 1.0):
        cfg = TrainConfig(method="binary", lora_rank=8, lora_alpha=16, lr=1e-2, penalty_until_nats=until)
        model, opt = tiny_policy(cfg)
        for _ in range(5):
            train_step(model, opt, samples, cfg)
        with torch.no_grad():
            lp0 = model(input_ids=P).logits[:, -1].float().log_softmax(-1).gather(-1, first_B[:, None])[:, 0]
            after = model(input_ids=torch.cat([P, first_B[:, None]], 1)).logits[:, -1].float().log_softmax(-1)
        moved[until] = (float((lp0 - lp0_B).mean()), float((after.gather(-1, second_B[:, None])[:, 0] - lp1_B).mean()))
    assert moved[None][0] < -1.0 and moved[1.0][0] < -1.0, moved
    assert moved[None][1] < -1.0 and moved[1.0][1] > 0.5 * moved[None][1], moved


def test_a_distilled_sample_raises_a_token_the_student_finds_unlikely():
    """Note consolidation: in the context it trains in, the student gives the teacher's favourite
    token little probability (its 40th most likely), so the π-weighted top-K term barely moves
    it; the distillation term raises it in proportion to the teacher's 0.6."""
    P = prompts()
    moved = {}
    for distill in (True, False):
        cfg = TrainConfig(method="opd", lora_rank=8, lora_alpha=16, lr=1e-2, opd_top_k=4)
        model, opt = tiny_policy(cfg)
        with torch.no_grad():
            logp_B_V = model(input_ids=P).logits[:, -1].float().log_softmax(-1)
        order_B_V = logp_B_V.argsort(-1, descending=True)
        ids_B_K = torch.cat([order_B_V[:, :3], order_B_V[:, 39:40]], 1)
        wanted_B = ids_B_K[:, 3]
        top_B_K = logp_B_V.gather(-1, ids_B_K)
        teacher_B_K = torch.log(torch.tensor([0.1, 0.1, 0.1, 0.6])).expand(N, 4)
        samples = [Sample(P[i].tolist(), [int(ids_B_K[i, 0])], [float(top_B_K[i, 0])], 0.0, [float(top_B_K[i, 0])],
                          top_ids=[ids_B_K[i].tolist()], top_logprobs=[top_B_K[i].tolist()],
                          teacher_top_logprobs=[teacher_B_K[i].tolist()], distill=distill) for i in range(N)]
        start = logp_B_V.gather(-1, wanted_B[:, None]).mean()
        for _ in range(5):
            m = train_step(model, opt, samples, cfg)
        with torch.no_grad():
            end = model(input_ids=P).logits[:, -1].float().log_softmax(-1).gather(-1, wanted_B[:, None]).mean()
        moved[distill] = float(end - start)
        assert ("distill_kl" in m) == distill
    assert moved[True] > 1.0 and moved[True] > 3 * moved[False], moved


def test_positive_evidence_teaches_the_teachers_reply():
    """A sample carrying the teacher's own reply adds it as a row with advantage evidence_weight:
    its tokens gain; with the weight at 0 the same samples leave them where they were."""
    P = prompts()
    moved = {}
    for weight in (1.0, 0.0):
        cfg = TrainConfig(method="opd", lora_rank=8, lora_alpha=16, lr=1e-2, opd_top_k=0, evidence_weight=weight)
        model, opt = tiny_policy(cfg)
        with torch.no_grad():
            logp_B_V = model(input_ids=P).logits[:, -1].float().log_softmax(-1)
        start = float(logp_B_V[:, TARGET].mean())
        samples = [Sample(P[i].tolist(), [8], [float(logp_B_V[i, 8])], 0.0, [float(logp_B_V[i, 8])],
                          evidence_ids=[TARGET], evidence_logprobs=[float(logp_B_V[i, TARGET])]) for i in range(N)]
        for _ in range(5):
            m = train_step(model, opt, samples, cfg)
        moved[weight] = first_token_logp(model, P, TARGET) - start
        assert m["samples"] == N and m["evidence_rows"] == (N if weight else 0)
    assert moved[1.0] > 0.5 and abs(moved[0.0]) < 1e-3, moved


def test_evidence_with_the_teachers_logprobs_weighs_most_where_the_policy_is_furthest():
    """The teacher's reply is [TARGET, 8]: the teacher is sure of both, the policy (no hint) finds
    TARGET unlikely and 8 after it as likely as the teacher does. With the teacher's logprobs the
    row's advantage is evidence_weight + (teacher − behaviour): TARGET's share of the update
    grows, and it gains more than under the weight alone, which spreads evenly over both."""
    P = prompts()
    cfg = TrainConfig(method="opd", lora_rank=8, lora_alpha=16, lr=1e-2, opd_top_k=0, evidence_weight=1.0)
    with torch.no_grad():
        model, _ = tiny_policy(cfg)
        first_B_V = model(input_ids=P).logits[:, -1].float().log_softmax(-1)
        then_B_V = model(input_ids=torch.cat([P, torch.full((N, 1), TARGET)], 1)).logits[:, -1].float().log_softmax(-1)
    behaviour = [[float(first_B_V[i, TARGET]), float(then_B_V[i, 8])] for i in range(N)]
    moved = {}
    for knows in (False, True):
        samples = [Sample(P[i].tolist(), [8], [float(first_B_V[i, 8])], 0.0, [float(first_B_V[i, 8])],
                          evidence_ids=[TARGET, 8], evidence_logprobs=behaviour[i],
                          evidence_teacher_logprobs=[-0.05, behaviour[i][1]] if knows else None) for i in range(N)]
        row = with_evidence(samples[:1], 1.0)[1]
        assert list(row.teacher_logprobs or []) == ([-0.05, behaviour[0][1]] if knows else behaviour[0])
        assert row.prompt_ids == samples[0].prompt_ids
        assert with_evidence([replace(samples[0], evidence_prompt_ids=[3, 4])], 1.0)[1].prompt_ids == [3, 4]
        model, opt = tiny_policy(cfg)
        for _ in range(3):
            train_step(model, opt, samples, cfg)
        moved[knows] = first_token_logp(model, P, TARGET) - float(first_B_V[:, TARGET].mean())
    assert moved[False] > 0.2 and moved[True] > moved[False] + 0.2, moved


def test_a_loop_row_pushes_down_the_repeat_only():
    """A loop sample trains −loop_penalty on the loop's first repeat and nothing before it, whatever
    its reward: the token that restarts the loop loses probability, while the opener the same row
    carries moves far less than under Binary RL with the 👎 on the whole reply. With loop_penalty
    0 the row trains nothing."""
    P = prompts()
    opener, restart = 8, TARGET
    moved = {}
    for case, penalty, loop_from in (("loop", 1.0, 1), ("off", 0.0, 1), ("whole reply", 1.0, None)):
        cfg = TrainConfig(method="binary", lora_rank=8, lora_alpha=16, lr=1e-2, loop_penalty=penalty)
        model, opt = tiny_policy(cfg)
        P1 = torch.cat([P, torch.full((N, 1), opener)], 1)
        with torch.no_grad():
            first_B_V = model(input_ids=P).logits[:, -1].float().log_softmax(-1)
            second_B_V = model(input_ids=P1).logits[:, -1].float().log_softmax(-1)
        start = float(first_B_V[:, opener].mean()), float(second_B_V[:, restart].mean())
        samples = [Sample(P[i].tolist(), [opener, restart], [float(first_B_V[i, opener]), float(second_B_V[i, restart])],
                          -1.0, loop_from=loop_from) for i in range(N)]
        for _ in range(5):
            m = train_step(model, opt, samples, cfg)
        moved[case] = (first_token_logp(model, P, opener) - start[0], first_token_logp(model, P1, restart) - start[1])
        assert m["loop_rows"] == (N if loop_from else 0) and m["reward_neg"] == 1.0
    assert moved["loop"][1] < -2.0, moved
    assert moved["whole reply"][0] < 3 * moved["loop"][0] < 0, moved
    assert all(abs(v) < 1e-3 for v in moved["off"]), moved


def test_kl_anchor_from_clawback_toml_is_logged_and_non_zero(tmp_path):
    """kl_coef set in clawback.toml reaches the trainer, and every step logs the KL to the base
    model: non-zero once the adapter has moved."""
    from clawback.daemon.config import load_settings

    (tmp_path / "clawback.toml").write_text("[train]\npreset = \"binary\"\nkl_coef = 0.1\nlora_rank = 4\n"
                                            "lora_alpha = 8\nlr = 5e-2\n")
    cfg = load_settings(data_dir=tmp_path).train_config()
    assert (cfg.kl_coef, cfg.method) == (0.1, "binary")
    model, opt = tiny_policy(cfg)
    samples = random_samples(8, seed=4)
    kls = [train_step(model, opt, samples, cfg)["kl"] for _ in range(3)]
    assert kls[2] > 1e-4, kls


def test_opd_without_a_teacher_is_an_error():
    cfg = TrainConfig(method="opd", lora_rank=4, lora_alpha=8)
    model, opt = tiny_policy(cfg)
    with pytest.raises(ValueError, match="teacher"):
        train_step(model, opt, random_samples(2, seed=5), cfg)


def test_non_finite_gradient_skips_the_step():
    cfg = TrainConfig(lora_rank=4, lora_alpha=8, lr=1e-2)
    model, opt = tiny_policy(cfg)
    before = {k: v.clone() for k, v in model.named_parameters() if v.requires_grad}
    bad = random_samples(4, seed=6)
    bad[0] = Sample(bad[0].prompt_ids, bad[0].response_ids, [float("nan")] * len(bad[0].response_ids), 1.0)
    with pytest.raises(FloatingPointError):
        train_step(model, opt, bad, cfg)
    for k, v in model.named_parameters():
        if v.requires_grad:
            assert torch.equal(v, before[k])
    assert not opt.state  # AdamW never stepped


def test_the_step_can_yield_before_every_micro_batch():
    """The worker waits there while the daemon serves (trainer/priority.py)."""
    cfg = TrainConfig(lora_rank=4, lora_alpha=8, micro_batch_tokens=16)
    model, opt = tiny_policy(cfg)
    calls: list[int] = []
    metrics = train_step(model, opt, random_samples(6, seed=5), cfg, before_micro_batch=lambda: calls.append(1))
    assert len(calls) == metrics["micro_batches"] > 1


def test_on_cpu_a_step_splits_at_the_documented_default_budget():
    """The default token budget depends on the device (trainer/config.py); docs/architecture.md
    states it, and a CPU step with the default config splits where it says."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    cpu, cuda = MICRO_BATCH_TOKENS["cpu"], MICRO_BATCH_TOKENS["cuda"]
    assert f"`micro_batch_tokens` defaults to {cpu} padded tokens on CPU and {cuda} on CUDA" in " ".join(doc.split())
    cfg = TrainConfig(lora_rank=4, lora_alpha=8)
    assert cfg.micro_batch_tokens is None and TrainConfig(micro_batch_tokens=512).token_budget("cpu") == 512
    model, opt = tiny_policy(cfg)
    g = torch.Generator().manual_seed(3)
    P, R = cpu // 4 + 100, 8  # three fit the CPU budget, four do not
    samples = [Sample(prompt_ids=torch.randint(8, V, (P,), generator=g).tolist(),
                      response_ids=torch.randint(8, V, (R,), generator=g).tolist(),
                      behaviour_logprobs=[-1.0] * R, reward=1.0) for _ in range(4)]
    assert cuda >= 4 * (P + R) and 3 * (P + R) <= cpu < 4 * (P + R)
    assert train_step(model, opt, samples, cfg)["micro_batches"] == 2
