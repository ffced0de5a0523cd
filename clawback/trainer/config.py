"""The one training config: a small frozen dataclass, plus named presets.

Every knob of the loss lives here with its meaning; `losses.py` and `step.py` read nothing else.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from clawback.adapter_format import ALL_LINEAR

Method = Literal["binary", "opd", "combined"]


MICRO_BATCH_TOKENS = {"cuda": 8192, "cpu": 2048}  # by torch device type; others get the CPU value


@dataclass(frozen=True)
class TrainConfig:
    # Per-token advantage A_t (see losses.advantages):
    #   binary    A_t = w_binary·r
    #   opd       A_t = w_opd·(teacher_logprob_t − behaviour_logprob_t)
    #   combined  A_t = w_binary·r + w_opd·(teacher_logprob_t − behaviour_logprob_t)
    # A sample without teacher logprobs contributes only its reward term (combined) or is an
    # error (opd): its OPD term would otherwise be inference/training drift, not a signal.
    method: Method = "combined"
    w_binary: float = 1.0
    w_opd: float = 1.0
    # Top-K OPD (opd, combined): the OPD term covers the policy's K most likely tokens at each
    # response position (recorded at serve time, scored by the teacher under the hinted context),
    # not only the sampled one. For each such token k: A_k = w_opd·clip(teacher_k − behaviour_k,
    # −opd_clip, opd_clip), and the position's loss is −Σ_k π(k)·A_k (gradient Σ_k π(k)·A_k·∇log π(k),
    # the expectation of the sampled-token estimator over those K tokens). No importance weight:
    # the term is an exact sum over the K tokens under the current π, not an estimate from a token
    # some other policy sampled, so there is nothing to correct for.
    # A sample without recorded top-K (an engine that cannot score candidates) trains token-level.
    # 0 = token-level OPD: A_t = w_opd·(teacher_t − behaviour_t) on the sampled token, unclipped.
    opd_top_k: int = 4
    opd_clip: float = 1.0
    # Where a reply left what the hint asks: from the first position at which the teacher puts the
    # reply's own token more than `topk_until_nats` below the behaviour policy, the teacher saw a
    # prefix it would not have written, and its top-K there repairs that prefix ("Great question!"
    # at the final answer of a reply that did not open with it) rather than says what the next
    # token should have been. Top-K OPD (and distillation) then cover the positions up to and
    # including that one; the later ones train on the sampled token (A_t = w_opd·(teacher_t −
    # behaviour_t)). None = top-K at every position (bench/README.md, "Top-K up to the divergence").
    topk_until_nats: float | None = 1.0
    # A negative reward on a sample with a teacher (a 👎 or correction with a hint) falls on its
    # positions up to and including the first where the teacher puts the reply's own token more
    # than `penalty_until_nats` below the behaviour policy: what the person rejected is where the
    # reply left what they asked (its opener, say), not the working and answer after it. The later
    # positions get no reward term (their OPD term stays). None = the reward on every token, as
    # for every other sample (bench/README.md, "A correction's penalty up to the divergence").
    penalty_until_nats: float | None = 1.0
    # Distilled samples (opd, combined): a sample that trains in another context than its teacher
    # beyond the hint (note consolidation: the request without the preference notes its reply was
    # served with) adds distill_weight·KL(teacher ‖ π) over its recorded top-K and the rest of
    # the vocabulary at each response position (losses.topk_distill_term). There the tokens the
    # notes asked for are unlikely under π, and the top-K term, weighted by π, barely raises
    # them; this term raises them in proportion to the teacher. 0 = off.
    distill_weight: float = 1.0
    # Positive evidence (opd, combined): a sample that carries the teacher's own reply under the
    # hint adds that reply as one more row of the batch, in the sample's original context, with
    # A_t = evidence_weight + w_opd·(teacher_t − behaviour_t) on every token: the teacher's reply
    # weighted as a whole, and most where the policy without the hint is furthest from it (its
    # behaviour logprobs are the policy's own, so the importance weight is 1). 0 = off.
    evidence_weight: float = 0.0
    # > 0: a reply that falls into a repetition loop (the same 6 tokens three times) and that the
    # person marked wrong (👎 or a correction) trains against the loop, whatever the method: the
    # row keeps the reply up to the end of the loop's first repeat, with A_t = −loop_penalty on that
    # repeat's tokens and 0 before it (no reward, no teacher: the prefix before the repeat may be
    # fine, and the hinted teacher does not disfavour the repeat). Off by default: where the wanted
    # reply itself repeats ("Sure!\nSure!…"), pushing the repeat down also pushed the wanted opener
    # down (bench/README.md, "Training against loops"). 0 = such samples are dropped
    # (reason repetition_loop).
    loop_penalty: float = 0.0

    # PPO clipped surrogate on ratio = exp(logp_new − logp_old), clipped to [1−clip_low, 1+clip_high].
    clip_low: float = 0.2
    clip_high: float = 0.28
    # Truncated importance sampling: each token's loss is weighted by
    # min(exp(logp_old − logp_behaviour), tis_cap), detached. It corrects for samples served by
    # an older adapter (and for engine/trainer numeric drift). None turns the correction off.
    tis_cap: float | None = 2.0
    # KL penalty to the base model (the adapter disabled): an anchor that keeps the policy near
    # what it was, added per token as kl_coef·k3 with the
    # low-variance "k3" estimator k3 = exp(ref − logp) − (ref − logp) − 1 ≥ 0 (Schulman, "Approximating
    # KL divergence"), on the sampled tokens. 0 disables it and skips the reference forward pass.
    # This is the only place the KL coefficient is defined.
    kl_coef: float = 0.0
    # Entropy bonus: loss −= entropy_coef · H(π(·|s_t)) per response token. Entropy is always reported.
    entropy_coef: float = 0.0

    # LoRA. Plain LoRA only: SGLang's loader ignores rsLoRA scaling and rejects DoRA, so an
    # adapter trained with either would be served wrong or not at all.
    lora_rank: int = 16
    lora_alpha: int = 32
    target_modules: str | tuple[str, ...] = ALL_LINEAR  # every linear projection except lm_head

    # AdamW. Each batch gets `updates_per_batch` optimizer steps over the same samples (PPO
    # epochs): logp_old is the policy before the first, so from the second on the ratio moves and
    # the clip (and, for top-K OPD, the same clip on each of the K tokens) bounds how far the
    # batch can push. 1 = one step per batch, where the clip never binds.
    updates_per_batch: int = 1
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0
    batch_size: int = 16  # effective samples per optimizer step
    # Padded tokens (prompt + response) per forward/backward; None = `MICRO_BATCH_TOKENS` for the
    # device the step runs on. CPU gets less: without checkpointing SmolLM2-135M's trainer peaked
    # at 5.7 GB with 2048 and went past 13 GB with 8192 (bench/README.md, "Trainer RSS").
    micro_batch_tokens: int | None = None
    # Samples served more than this many adapter versions ago are dropped by the caller, not
    # reweighted: past a few versions the TIS weight is mostly at its cap and carries little signal.
    max_staleness: int = 4
    seed: int = 0  # LoRA initialisation
    # Recompute each decoder layer's activations in the backward pass instead of storing them:
    # ~30% more compute for activations that shrink from O(layers) to O(1) layers. On by default:
    # a 4B model at the default token budget does not fit a 24 GB card without it
    # (docs/memory-plan.md), and on CPU it is what keeps a laptop's trainer within a few GB
    # (bench/README.md, "Trainer memory"); the recomputation is also where the trainer yields to
    # requests inside the backward (trainer/priority.py).
    gradient_checkpointing: bool = True

    def __post_init__(self) -> None:
        if self.method not in ("binary", "opd", "combined"):
            raise ValueError(f"unknown method {self.method!r}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("need 0 <= clip_low < 1 and clip_high >= 0")
        if self.tis_cap is not None and self.tis_cap < 1:
            raise ValueError("tis_cap must be >= 1 (or None to disable)")
        if (self.opd_top_k < 0 or self.opd_clip <= 0 or self.evidence_weight < 0 or self.loop_penalty < 0
                or self.distill_weight < 0):
            raise ValueError("need opd_top_k >= 0, opd_clip > 0, and evidence_weight, loop_penalty and "
                             "distill_weight >= 0")
        if self.topk_until_nats is not None and self.topk_until_nats < 0:
            raise ValueError("topk_until_nats must be >= 0 (or None: top-K at every position)")
        if self.penalty_until_nats is not None and self.penalty_until_nats < 0:
            raise ValueError("penalty_until_nats must be >= 0 (or None: a penalty on every token)")
        if self.updates_per_batch < 1:
            raise ValueError("updates_per_batch must be >= 1")
        if self.lora_rank < 1 or self.batch_size < 1 or (self.micro_batch_tokens is not None and self.micro_batch_tokens < 1):
            raise ValueError("lora_rank, batch_size and micro_batch_tokens must be positive")

    def token_budget(self, device_type: str) -> int:
        """Padded tokens per micro-batch on a device of this type."""
        return self.micro_batch_tokens or MICRO_BATCH_TOKENS.get(device_type, MICRO_BATCH_TOKENS["cpu"])

    @property
    def advantage_weights(self) -> tuple[float, float]:
        """(w_binary, w_opd) as the method uses them: one formula serves all three methods."""
        if self.method == "binary":
            return self.w_binary, 0.0
        if self.method == "opd":
            return 0.0, self.w_opd
        return self.w_binary, self.w_opd


PRESETS: dict[str, TrainConfig] = {
    "binary": TrainConfig(method="binary"),
    "opd": TrainConfig(method="opd"),
    "combined": TrainConfig(method="combined"),
    # The original project's recipe (OpenClaw-RL combine, LoRA scripts): combined advantage with
    # both weights 1, PPO clip 0.2/0.28, no importance-sampling correction, no KL, Adam lr 1e-5,
    # weight decay 0.1, betas (0.9, 0.98), rank 16 / alpha 32, batch 16. Two differences remain by
    # design: its OPD baseline was the trainer's recomputed logprob (so drift leaked into A_t),
    # and it summed per-sample means over the batch where we average them (a constant lr factor).
    "seed": TrainConfig(
        method="combined", tis_cap=None, kl_coef=0.0, lr=1e-5, weight_decay=0.1, betas=(0.9, 0.98), opd_top_k=0
    ),
}


def preset(name: str, **overrides) -> TrainConfig:
    """A named preset with some fields replaced: preset("binary", lr=3e-5)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}") from None
    return dataclasses.replace(base, **overrides)
