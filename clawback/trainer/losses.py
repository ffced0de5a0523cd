"""Per-token advantages and the clipped, importance-corrected policy loss.

Pure tensor functions. Shapes are in the names: B samples, T response positions (right-padded).
`mask_B_T` is 1.0 on real response tokens and 0.0 on padding; padding never reaches the loss or
the metrics, but must hold finite values (a NaN there would still poison the gradient through
torch.where). All logprobs are of the sampled tokens.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def advantages(
    reward_B_T: Tensor,
    teacher_logp_B_T: Tensor,
    behaviour_logp_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    w_binary: float,
    w_opd: float,
    bonus_B_T: Tensor | None = None,
) -> Tensor:
    """A_t = w_binary·r_t + w_opd·(teacher_t − behaviour_t) (+ bonus_B_T), zero on padding.

    r_t is the sample's reward on the positions it falls on (step.collate) and 0 elsewhere.
    Binary RL is w_opd = 0, OPD is w_binary = 0 (TrainConfig.advantage_weights). The OPD baseline
    is the recorded behaviour logprob, not the trainer's recomputed one, so engine/trainer drift
    does not leak into the advantage. Pass teacher = behaviour for a sample without a teacher.
    """
    adv_B_T = w_binary * reward_B_T + w_opd * (teacher_logp_B_T - behaviour_logp_B_T)
    if bonus_B_T is not None:  # positive evidence and loop rows (TrainConfig.evidence_weight, loop_penalty)
        adv_B_T = adv_B_T + bonus_B_T
    return torch.where(mask_B_T.bool(), adv_B_T, 0.0)


def topk_advantages(
    teacher_B_T_K: Tensor, behaviour_B_T_K: Tensor, mask_B_T: Tensor, *, w_opd: float, clip: float
) -> Tensor:
    """A_k = w_opd·clip(teacher_k − behaviour_k, −clip, clip) for each of the K tokens, 0 on padding."""
    adv = w_opd * (teacher_B_T_K - behaviour_B_T_K).clamp(-clip, clip)
    return torch.where(mask_B_T.bool()[..., None], adv, 0.0)


def topk_policy_term(logp_B_T_K: Tensor, adv_B_T_K: Tensor, old_logp_B_T_K: Tensor | None = None, *,
                     clip_low: float = 0.2, clip_high: float = 0.28) -> Tensor:
    """Per position −Σ_k π_old(k)·min(r_k·A_k, clip(r_k)·A_k) with r_k = π(k)/π_old(k): the
    clipped surrogate of the sampled-token policy gradient, in expectation over the K tokens.
    old = None means the policy before this update is the current one (r_k = 1), where the
    gradient is −Σ_k π(k)·A_k·∇log π(k); over several updates of a batch the clip stops a token
    that has moved far enough."""
    old_B_T_K = logp_B_T_K.detach() if old_logp_B_T_K is None else old_logp_B_T_K.detach()
    ratio_B_T_K = torch.exp(logp_B_T_K - old_B_T_K)
    clipped_B_T_K = ratio_B_T_K.clamp(1.0 - clip_low, 1.0 + clip_high)
    surrogate_B_T_K = torch.minimum(ratio_B_T_K * adv_B_T_K, clipped_B_T_K * adv_B_T_K)
    return -(old_B_T_K.exp() * surrogate_B_T_K).sum(-1)


def topk_distill_term(logp_B_T_K: Tensor, teacher_B_T_K: Tensor, eps: float = 1e-6) -> Tensor:
    """Per position KL(teacher ‖ π) over K+1 outcomes, the K tokens and the rest of the
    vocabulary: Σ_k p_T(k)·(log p_T(k) − log π(k)) + p_T(rest)·(log p_T(rest) − log π(rest)).
    Its gradient raises each token in proportion to the teacher's probability of it, however
    unlikely under π, and is 0 where the two agree (the rest bucket keeps it from sharpening π
    onto the K tokens)."""
    teacher_B_T_K = teacher_B_T_K.detach()
    rest_t_B_T = torch.log((1.0 - teacher_B_T_K.exp().sum(-1)).clamp(min=eps))
    rest_B_T = torch.log((1.0 - logp_B_T_K.exp().sum(-1)).clamp(min=eps))
    tokens_B_T = (teacher_B_T_K.exp() * (teacher_B_T_K - logp_B_T_K)).sum(-1)
    return tokens_B_T + rest_t_B_T.exp() * (rest_t_B_T - rest_B_T)


def masked_mean(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Token-mean of each sample over its real tokens -> x_B (0 for an all-padding row)."""
    m = mask_B_T.bool()
    return torch.where(m, x_B_T, 0.0).sum(-1) / m.sum(-1).clamp(min=1)


def _token_mean(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    m = mask_B_T.bool()
    return torch.where(m, x_B_T.float(), 0.0).sum() / m.sum().clamp(min=1)


def policy_loss(
    logp_B_T: Tensor,
    old_logp_B_T: Tensor,
    behaviour_logp_B_T: Tensor,
    adv_B_T: Tensor,
    mask_B_T: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    tis_cap: float | None = 2.0,
    ref_logp_B_T: Tensor | None = None,
    kl_coef: float = 0.0,
    entropy_B_T: Tensor | None = None,
    entropy_coef: float = 0.0,
    topk_B_T: Tensor | None = None,
    sampling_logp_B_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per token: tis·max(−ratio·A, −clip(ratio)·A) + kl_coef·k3 − entropy_coef·H; token-mean per
    sample, then mean over the batch.

    logp: current policy, with grad. old: the same policy before this update (no grad).
    behaviour: what the serving engine recorded when it sampled the token. ref: the base model,
    needed only when kl_coef > 0. entropy: full-vocabulary entropy at each position. topk: the
    top-K OPD term per position (topk_policy_term). sampling: the logprob of each token under the
    distribution it was actually drawn from (temperature, top-p); when given, the TIS weight is
    min(exp(old − sampling), tis_cap), which corrects for sampling at a temperature other than 1
    as well as for staleness; without it the weight is against `behaviour` (temperature 1).

    Metrics are 0-dim detached tensors, token-means over all real tokens of the batch:
    clip_low / clip_high (fraction of tokens whose gradient the clip removed on that side),
    ratio, tis (mean weight), adv, drift = |old − behaviour|, kl and entropy when given.
    """
    old_logp_B_T = old_logp_B_T.detach()
    ratio_B_T = torch.exp(logp_B_T - old_logp_B_T)
    clipped_B_T = ratio_B_T.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg_B_T = torch.maximum(-ratio_B_T * adv_B_T, -clipped_B_T * adv_B_T)

    # The samples came from the behaviour policy, the surrogate assumes the old one: reweight by
    # their ratio, truncated so one very stale token cannot dominate the batch.
    if tis_cap is None:
        tis_B_T = torch.ones_like(pg_B_T)
    else:
        reference_B_T = behaviour_logp_B_T if sampling_logp_B_T is None else sampling_logp_B_T
        tis_B_T = torch.exp(old_logp_B_T - reference_B_T.detach()).clamp(max=tis_cap)
    per_token_B_T = tis_B_T * pg_B_T
    if topk_B_T is not None:  # a sum over actions, not a sampled one: no importance weight
        per_token_B_T = per_token_B_T + topk_B_T

    kl_B_T = None
    if ref_logp_B_T is not None:
        delta_B_T = ref_logp_B_T.detach() - logp_B_T
        kl_B_T = torch.exp(delta_B_T) - delta_B_T - 1.0
        if kl_coef:
            per_token_B_T = per_token_B_T + kl_coef * kl_B_T
    if entropy_B_T is not None and entropy_coef:
        per_token_B_T = per_token_B_T - entropy_coef * entropy_B_T

    loss = masked_mean(per_token_B_T, mask_B_T).mean()

    with torch.no_grad():
        metrics = {
            "clip_low": _token_mean((ratio_B_T < 1.0 - clip_low) & (adv_B_T < 0), mask_B_T),
            "clip_high": _token_mean((ratio_B_T > 1.0 + clip_high) & (adv_B_T > 0), mask_B_T),
            "ratio": _token_mean(ratio_B_T, mask_B_T),
            "tis": _token_mean(tis_B_T, mask_B_T),
            "adv": _token_mean(adv_B_T, mask_B_T),
            "drift": _token_mean((old_logp_B_T - behaviour_logp_B_T).abs(), mask_B_T),
        }
        if kl_B_T is not None:
            metrics["kl"] = _token_mean(kl_B_T, mask_B_T)
        if entropy_B_T is not None:
            metrics["entropy"] = _token_mean(entropy_B_T, mask_B_T)
    return loss, metrics
