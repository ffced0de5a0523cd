"""The loss functions against values computed by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from clawback.trainer.config import PRESETS, TrainConfig, preset
from clawback.trainer.losses import (
    advantages,
    masked_mean,
    policy_loss,
    topk_advantages,
    topk_distill_term,
    topk_policy_term,
)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def leaf(*rows):
    return t(*rows).requires_grad_(True)


def test_clip_binds_on_both_sides_only_where_it_should():
    # ratio 1.5 / 0.5 against A = +1 / −1, clip range [0.8, 1.28]:
    #   r=1.5, A=+1: max(−1.5, −1.28) = −1.28  clipped high, no gradient
    #   r=0.5, A=−1: max( 0.5,  0.8)  =  0.8   clipped low,  no gradient
    #   r=1.5, A=−1: max( 1.5,  1.28) =  1.5   unclipped: a too-likely bad token is always pushed down
    #   r=0.5, A=+1: max(−0.5, −0.8)  = −0.5   unclipped: a too-unlikely good token is always pushed up
    old = t([0.0, 0.0, 0.0, 0.0])
    logp = leaf([math.log(1.5), math.log(0.5), math.log(1.5), math.log(0.5)])
    adv = t([1.0, -1.0, -1.0, 1.0])
    mask = t([1.0, 1.0, 1.0, 1.0])
    loss, m = policy_loss(logp, old, old, adv, mask, clip_low=0.2, clip_high=0.28, tis_cap=None)
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 1.5 - 0.5) / 4)
    assert float(m["clip_high"]) == pytest.approx(0.25) and float(m["clip_low"]) == pytest.approx(0.25)
    assert float(m["ratio"]) == pytest.approx(1.0)
    loss.backward()
    # d/dlogp of −r·A/4 is −r·A/4 (dr/dlogp = r); clipped tokens get exactly 0.
    torch.testing.assert_close(logp.grad, t([0.0, 0.0, 1.5 / 4, -0.5 / 4]))


def test_asymmetric_clip_uses_each_bound_on_its_own_side():
    # ratio 1.25 is inside [0.8, 1.28] (ε_high 0.28) but would be clipped by a symmetric 0.2.
    old = t([0.0, 0.0])
    logp = leaf([math.log(1.25), math.log(0.79)])
    adv = t([1.0, -1.0])
    _, m = policy_loss(logp, old, old, adv, t([1.0, 1.0]), clip_low=0.2, clip_high=0.28, tis_cap=None)
    assert float(m["clip_high"]) == 0.0 and float(m["clip_low"]) == pytest.approx(0.5)


def test_tis_weight_is_truncated_at_the_cap_and_detached():
    # Old policy 3× / 0.5× as likely as the behaviour policy that sampled the token: weights 3 → 2 (cap), 0.5.
    old = t([math.log(0.3), math.log(0.1)])
    behaviour = t([math.log(0.1), math.log(0.2)])
    logp = leaf([math.log(0.3), math.log(0.1)])  # ratio 1
    adv = t([1.0, 1.0])
    mask = t([1.0, 1.0])
    loss, m = policy_loss(logp, old, behaviour, adv, mask, tis_cap=2.0)
    assert loss.item() == pytest.approx(-(2.0 + 0.5) / 2)
    assert float(m["tis"]) == pytest.approx(1.25)
    assert float(m["drift"]) == pytest.approx((math.log(3) + math.log(2)) / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, t([-2.0 / 2, -0.5 / 2]))  # the weight scales, never differentiates

    off, m_off = policy_loss(logp, old, behaviour, adv, mask, tis_cap=None)
    assert off.item() == pytest.approx(-1.0) and float(m_off["tis"]) == 1.0


def test_padding_is_ignored_and_each_sample_is_a_token_mean_then_batch_mean():
    # Sample 0: one real token, A=3. Sample 1: three real tokens, A=1.
    # Per-sample token means −3 and −1 -> batch mean −2 (a flat token mean would give −1.5).
    # Padding holds wild but finite values (ratio e^5, A 7) that must change nothing.
    mask = t([1.0, 0.0, 0.0], [1.0, 1.0, 1.0])
    adv = t([3.0, 7.0, 7.0], [1.0, 1.0, 1.0])
    logp = leaf([0.0, 5.0, 5.0], [0.0, 0.0, 0.0])
    old = t([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])
    loss, m = policy_loss(logp, old, old, adv, mask, tis_cap=2.0)
    assert loss.item() == pytest.approx(-2.0)
    assert float(m["adv"]) == pytest.approx(6 / 4) and float(m["ratio"]) == pytest.approx(1.0)
    assert float(m["clip_high"]) == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, t([-3 / 2, 0.0, 0.0], [-1 / 6, -1 / 6, -1 / 6]))
    assert masked_mean(t([2.0, 9.0], [0.0, 0.0]), t([1.0, 0.0], [0.0, 0.0])).tolist() == [2.0, 0.0]


def test_combined_advantage_weights_and_methods():
    reward = t([1.0, 1.0], [-1.0, -1.0])
    teacher = t([-1.0, -2.0], [-0.5, 9.0])
    behaviour = t([-2.0, -2.0], [-1.5, 0.0])
    mask = t([1.0, 1.0], [1.0, 0.0])
    adv = advantages(reward, teacher, behaviour, mask, w_binary=0.5, w_opd=2.0)
    # A = 0.5·r + 2·(teacher − behaviour); the padded slot is 0 whatever it holds.
    torch.testing.assert_close(adv, t([0.5 + 2.0, 0.5 + 0.0], [-0.5 + 2.0, 0.0]))

    assert TrainConfig(method="binary", w_binary=0.5, w_opd=2.0).advantage_weights == (0.5, 0.0)
    assert TrainConfig(method="opd", w_binary=0.5, w_opd=2.0).advantage_weights == (0.0, 2.0)
    assert TrainConfig(method="combined", w_binary=0.5, w_opd=2.0).advantage_weights == (0.5, 2.0)
    binary = advantages(reward, teacher, behaviour, mask, w_binary=1.0, w_opd=0.0)
    torch.testing.assert_close(binary, t([1.0, 1.0], [-1.0, 0.0]))


def test_kl_to_base_uses_the_k3_estimator():
    # logp = log 0.5, ref = log 0.25: d = ref − logp = −log 2, k3 = e^d − d − 1 = 0.5 + log 2 − 1.
    k3 = 0.5 + math.log(2) - 1
    logp = leaf([math.log(0.5)])
    ref = t([math.log(0.25)])
    zero_adv, mask = t([0.0]), t([1.0])
    loss, m = policy_loss(logp, logp.detach(), logp.detach(), zero_adv, mask, ref_logp_B_T=ref, kl_coef=0.1)
    assert loss.item() == pytest.approx(0.1 * k3) and float(m["kl"]) == pytest.approx(k3)
    loss.backward()
    assert float(logp.grad) == pytest.approx(0.1 * (1 - 0.5))  # d k3 / d logp = 1 − e^d

    # Coefficient 0: measured, not in the loss.
    loss0, m0 = policy_loss(logp, logp.detach(), logp.detach(), zero_adv, mask, ref_logp_B_T=ref, kl_coef=0.0)
    assert loss0.item() == 0.0 and float(m0["kl"]) == pytest.approx(k3)


def test_entropy_bonus_lowers_the_loss_by_coef_times_entropy():
    ent = leaf([1.0, 2.0, 50.0])
    mask = t([1.0, 1.0, 0.0])
    z = t([0.0, 0.0, 0.0])
    loss, m = policy_loss(z.clone(), z, z, z, mask, entropy_B_T=ent, entropy_coef=0.1)
    assert loss.item() == pytest.approx(-0.1 * 1.5) and float(m["entropy"]) == pytest.approx(1.5)
    loss.backward()
    torch.testing.assert_close(ent.grad, t([-0.05, -0.05, 0.0]))
    loss0, m0 = policy_loss(z.clone(), z, z, z, mask, entropy_B_T=ent.detach(), entropy_coef=0.0)
    assert loss0.item() == 0.0 and float(m0["entropy"]) == pytest.approx(1.5)


def test_presets_and_validation():
    seed = PRESETS["seed"]
    assert (seed.method, seed.tis_cap, seed.kl_coef, seed.lr) == ("combined", None, 0.0, 1e-5)
    assert (seed.clip_low, seed.clip_high, seed.lora_rank, seed.lora_alpha) == (0.2, 0.28, 16, 32)
    assert preset("binary", lr=3e-5).lr == 3e-5 and preset("binary").method == "binary"
    with pytest.raises(ValueError):
        preset("nope")
    with pytest.raises(ValueError):
        TrainConfig(method="grpo")
    with pytest.raises(ValueError):
        TrainConfig(tis_cap=0.5)


def test_tis_is_against_the_sampling_distribution_when_recorded():
    # Sampled at temperature 0.5: the token had probability 0.6 under the sampling distribution
    # but 0.3 under the policy (temperature 1). The weight corrects towards the policy: 0.3/0.6.
    logp = leaf([math.log(0.3)])
    behaviour = t([math.log(0.3)])
    loss, m = policy_loss(logp, logp.detach(), behaviour, t([1.0]), t([1.0]), sampling_logp_B_T=t([math.log(0.6)]))
    assert float(m["tis"]) == pytest.approx(0.5) and float(m["drift"]) == pytest.approx(0.0, abs=1e-6)
    assert loss.item() == pytest.approx(-0.5)


def test_topk_advantage_is_clipped_and_its_gradient_is_the_expectation_over_the_k_tokens():
    p = [0.5, 0.2, 0.1]
    logp = torch.tensor([[[math.log(x) for x in p]]], requires_grad=True)  # B=1, T=1, K=3
    behaviour = logp.detach().clone()
    teacher = behaviour + torch.tensor([[[3.0, -0.5, 0.0]]])
    adv = topk_advantages(teacher, behaviour, t([1.0]), w_opd=1.0, clip=1.0)
    torch.testing.assert_close(adv, torch.tensor([[[1.0, -0.5, 0.0]]]))  # +3 clipped to +1
    topk_policy_term(logp, adv).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[[-0.5 * 1.0, -0.2 * -0.5, 0.0]]]))  # −π(k)·A_k
    pad = topk_advantages(teacher, behaviour, t([0.0]), w_opd=1.0, clip=1.0)
    assert pad.abs().sum() == 0


def test_topk_distillation_is_the_kl_over_the_k_tokens_and_the_rest():
    student = torch.tensor([[[math.log(x) for x in (0.5, 0.2, 0.01)]]], requires_grad=True)
    assert float(topk_distill_term(student, student.detach()).detach().abs().sum()) < 1e-6  # agreeing: nothing to learn
    teacher = torch.tensor([[[math.log(x) for x in (0.2, 0.1, 0.6)]]])
    p, q = [0.2, 0.1, 0.6, 0.1], [0.5, 0.2, 0.01, 0.29]
    kl = topk_distill_term(student, teacher)
    assert float(kl) == pytest.approx(sum(a * math.log(a / b) for a, b in zip(p, q)), rel=1e-5)
    kl.sum().backward()
    # d/d log π(k) = −p_T(k) + p_T(rest)·π(k)/π(rest): the teacher's 0.6 pulls at full strength on
    # a token with π = 0.01, where the π-weighted top-K term's pull is 0.01·A.
    expected = [-a + 0.1 * b / 0.29 for a, b in zip(p[:3], q[:3])]
    assert student.grad is not None
    assert student.grad[0, 0].tolist() == pytest.approx(expected, rel=1e-4)


def test_topk_term_against_an_older_policy_is_clipped_per_token():
    """With logp_old given (a later update of the same batch), each of the K tokens follows the
    PPO clip: a token whose ratio has left [1 − 0.2, 1 + 0.28] in its advantage's direction gets
    no gradient; the others get −π_old(k)·r_k·A_k."""
    old = torch.tensor([[[math.log(0.5), math.log(0.2), math.log(0.1)]]])
    adv = torch.tensor([[[1.0, -0.5, 1.0]]])
    # token 0 rose by 50% (past 1.28, advantage > 0), token 1 fell by 30% (past 0.8, advantage < 0),
    # token 2 rose by 10% (inside the clip)
    logp = (old + torch.log(torch.tensor([[[1.5, 0.7, 1.1]]])).clone()).requires_grad_(True)
    topk_policy_term(logp, adv, old).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[[0.0, 0.0, -0.1 * 1.1 * 1.0]]]))
    same = logp.detach().clone().requires_grad_(True)  # logp_old = None: the ratio is 1
    topk_policy_term(same, adv).sum().backward()
    torch.testing.assert_close(same.grad, -same.detach().exp() * adv)
