"""One training step: samples -> micro-batches -> accumulated gradients -> AdamW step(s).

A sample is any `TrainSample`: `Sample` here, or the daemon's `clawback.records.ReadySample`;
the step turns each into the `Sample` rows it trains on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.utils.checkpoint
from transformers import PreTrainedModel

from clawback.adapter_format import lora_targets

from .config import TrainConfig
from .losses import advantages, policy_loss, topk_advantages, topk_distill_term, topk_policy_term


class TrainSample(Protocol):
    """Every field the trainer reads of a sample; `Sample` says what each one is."""

    @property
    def prompt_ids(self) -> Sequence[int]: ...
    @property
    def response_ids(self) -> Sequence[int]: ...
    @property
    def behaviour_logprobs(self) -> Sequence[float]: ...
    @property
    def reward(self) -> float: ...
    @property
    def teacher_logprobs(self) -> Sequence[float] | None: ...  # None: no teacher
    @property
    def sampling_logprobs(self) -> Sequence[float] | None: ...
    @property
    def top_ids(self) -> Sequence[Sequence[int]] | None: ...
    @property
    def top_logprobs(self) -> Sequence[Sequence[float]] | None: ...
    @property
    def teacher_top_logprobs(self) -> Sequence[Sequence[float]] | None: ...
    @property
    def evidence_ids(self) -> Sequence[int] | None: ...
    @property
    def evidence_logprobs(self) -> Sequence[float] | None: ...
    @property
    def evidence_teacher_logprobs(self) -> Sequence[float] | None: ...
    @property
    def evidence_prompt_ids(self) -> Sequence[int] | None: ...
    @property
    def loop_from(self) -> int | None: ...
    @property
    def distill(self) -> bool: ...


@dataclass(frozen=True)
class Sample:
    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    behaviour_logprobs: Sequence[float]  # temperature-1 logprobs of the policy that served them
    reward: float
    teacher_logprobs: Sequence[float] | None = None
    # Logprobs under the distribution actually sampled from (temperature, top-p): the TIS reference.
    sampling_logprobs: Sequence[float] | None = None
    # Top-K OPD, T x K each: the policy's K most likely ids at serve time, their behaviour
    # (temperature-1) logprobs, and the teacher's logprobs of the same ids. All three or none.
    top_ids: Sequence[Sequence[int]] | None = None
    top_logprobs: Sequence[Sequence[float]] | None = None
    teacher_top_logprobs: Sequence[Sequence[float]] | None = None
    # Positive evidence: the teacher's own reply under the hint, the policy's logprobs of it (no
    # hint; in evidence_prompt_ids when given, else in prompt_ids) and the teacher's (under the
    # hint); `with_evidence` turns it into a row of its own.
    evidence_ids: Sequence[int] | None = None
    evidence_logprobs: Sequence[float] | None = None
    evidence_teacher_logprobs: Sequence[float] | None = None
    evidence_prompt_ids: Sequence[int] | None = None
    # A loop sample: the response ends with the loop's first repeat, which starts here.
    loop_from: int | None = None
    # Its top-K teacher saw another context than prompt_ids plus a hint: distil it (TrainConfig.distill_weight).
    distill: bool = False
    # A fixed advantage on each response token from bonus_from on (evidence and loop rows).
    bonus: float = 0.0
    bonus_from: int = 0

    @classmethod
    def of(cls, s: TrainSample) -> Sample:
        return cls(s.prompt_ids, s.response_ids, s.behaviour_logprobs, s.reward, s.teacher_logprobs,
                   s.sampling_logprobs, s.top_ids, s.top_logprobs, s.teacher_top_logprobs, s.evidence_ids,
                   s.evidence_logprobs, s.evidence_teacher_logprobs, s.evidence_prompt_ids, s.loop_from, s.distill)


def with_evidence(samples: Sequence[Sample], weight: float) -> list[Sample]:
    """The samples plus, for each that carries positive evidence, a row of the teacher's reply in
    the context its logprobs were scored in: advantage `weight` on every token plus the OPD term
    where the teacher's logprobs of its reply are known (the row then trains as a liked reply
    taught by the same teacher would), no reward."""
    out = list(samples)
    if weight > 0:
        for s in samples:
            ids, lps, teacher = s.evidence_ids, s.evidence_logprobs, s.evidence_teacher_logprobs
            if ids and lps and len(ids) == len(lps):
                known = teacher is not None and len(teacher) == len(ids)
                out.append(Sample(s.evidence_prompt_ids or s.prompt_ids, ids, lps, 0.0, teacher if known else lps,
                                  bonus=weight))
    return out


def as_loop_rows(samples: Sequence[TrainSample], penalty: float) -> list[Sample]:
    """The samples as rows, each loop sample with advantage −`penalty` on the loop's first repeat
    and 0 before it: no reward and no teacher, whose signal would fall on the prefix as well."""
    out = []
    for s in samples:
        if s.loop_from is None:
            out.append(Sample.of(s))
        else:
            out.append(Sample(s.prompt_ids, s.response_ids, s.behaviour_logprobs, 0.0,
                              sampling_logprobs=s.sampling_logprobs, bonus=-penalty, bonus_from=s.loop_from))
    return out


def make_lora_model(base_model: PreTrainedModel, cfg: TrainConfig) -> Any:  # Any: peft types it as a union of model kinds
    """Wrap a HF causal LM with a fresh LoRA adapter ("default"); the base is modified in place."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=lora_targets(base_model, cfg.target_modules),
        lora_dropout=0.0,  # dropout would make logp_old differ from the logp being trained
        bias="none",
        task_type="CAUSAL_LM",
    )
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing needs no input that requires grad, so the frozen embeddings
        # of a LoRA model are fine as they are. transformers renamed the method in 5.2x.
        if hasattr(base_model, "activation_checkpointing_enable"):
            base_model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with torch.random.fork_rng():  # seed the LoRA init without touching the caller's RNG
        torch.manual_seed(cfg.seed)
        return get_peft_model(base_model, lora)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]  # fixed order: resume relies on it
    return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)


def micro_batches(samples: Sequence[Sample], token_budget: int) -> list[list[Sample]]:
    """Group samples so each padded micro-batch stays within `token_budget` tokens.

    Sorted by length so neighbours pad little; a sample longer than the budget goes alone.
    Padded size is rows × (longest prompt + longest response), the layout `collate` builds.
    """
    order = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.response_ids), reverse=True)
    out: list[list[Sample]] = []
    cur: list[Sample] = []
    max_p = max_r = 0
    for s in order:
        p, r = max(max_p, len(s.prompt_ids)), max(max_r, len(s.response_ids))
        if cur and (len(cur) + 1) * (p + r) > token_budget:
            out.append(cur)
            cur, p, r = [], len(s.prompt_ids), len(s.response_ids)
        cur.append(s)
        max_p, max_r = p, r
    if cur:
        out.append(cur)
    return out


def divergence_end(s: TrainSample, until_nats: float | None) -> int:
    """How many leading positions reach where the reply left its teacher's path: all of them, or
    up to and including the first where the teacher puts the reply's token more than `until_nats`
    below the behaviour policy (TrainConfig.topk_until_nats, penalty_until_nats)."""
    R = len(s.response_ids)
    if until_nats is None or s.teacher_logprobs is None:
        return R
    gaps = zip(s.teacher_logprobs, s.behaviour_logprobs, strict=True)
    return next((t + 1 for t, (teacher, behaviour) in enumerate(gaps) if teacher - behaviour < -until_nats), R)


def has_topk(s: TrainSample, k: int) -> bool:
    """The sample carries at least k recorded top tokens per position, with the teacher's view."""
    rows = s.top_ids
    return bool(k and rows and s.teacher_top_logprobs and s.top_logprobs
                and len(rows) == len(s.response_ids) and all(len(r) >= k for r in rows))


def collate(samples: Sequence[Sample], device: torch.device, top_k: int = 0,
            topk_until_nats: float | None = None, penalty_until_nats: float | None = None) -> dict[str, torch.Tensor]:
    """Prompts right-aligned at column C, responses left-aligned from C:

        [pad pad p p p | r r r pad]
        [pad p p p p p | r r pad pad]

    so the logits that predict every response token sit in the same last T+1 columns of every
    row, and the model computes logits for those columns only (`logits_to_keep`). Explicit
    position_ids keep each row's positions starting at 0 despite the left padding.
    `topk_B_T` marks the positions a top-K teacher covers (TrainConfig.topk_until_nats); the
    others carry the sampled-token teacher. `reward_B_T` is each sample's reward on the positions
    it falls on: all of them, or a negative reward's up to the divergence (penalty_until_nats).
    """
    B = len(samples)
    C = max(len(s.prompt_ids) for s in samples)
    T = max(len(s.response_ids) for s in samples)
    ids_B_L = torch.zeros(B, C + T, dtype=torch.long)
    attn_B_L = torch.zeros(B, C + T, dtype=torch.long)
    behaviour_B_T = torch.zeros(B, T)
    sampling_B_T = torch.zeros(B, T)
    teacher_B_T = torch.zeros(B, T)
    K = max(top_k, 1)
    top_ids_B_T_K = torch.zeros(B, T, K, dtype=torch.long)
    top_behaviour_B_T_K = torch.zeros(B, T, K)
    top_teacher_B_T_K = torch.zeros(B, T, K)
    topk_B_T = torch.zeros(B, T)
    reward_B_T = torch.zeros(B, T)
    distill_B = torch.zeros(B)
    bonus_B_T = torch.zeros(B, T)
    for i, s in enumerate(samples):
        P, R = len(s.prompt_ids), len(s.response_ids)
        ids_B_L[i, C - P : C] = torch.tensor(list(s.prompt_ids))
        ids_B_L[i, C : C + R] = torch.tensor(list(s.response_ids))
        attn_B_L[i, C - P : C + R] = 1
        behaviour_B_T[i, :R] = torch.tensor(list(s.behaviour_logprobs))
        sampled = s.sampling_logprobs
        sampling_B_T[i, :R] = torch.tensor(list(sampled if sampled is not None else s.behaviour_logprobs))
        # No teacher, or a top-K teacher: the sampled-token OPD term is exactly 0 (teacher = behaviour).
        use_topk = has_topk(s, top_k)
        teacher = s.teacher_logprobs if s.teacher_logprobs is not None else s.behaviour_logprobs
        topk_to = divergence_end(s, topk_until_nats) if use_topk else 0
        reward_B_T[i, : divergence_end(s, penalty_until_nats) if s.reward < 0 else R] = float(s.reward)
        teacher_B_T[i, :R] = torch.tensor(list(s.behaviour_logprobs[:topk_to]) + list(teacher[topk_to:]))
        bonus_B_T[i, s.bonus_from:R] = float(s.bonus)
        if use_topk:
            topk_B_T[i, :topk_to] = 1.0
            distill_B[i] = float(s.distill)
            assert s.top_ids and s.top_logprobs and s.teacher_top_logprobs  # has_topk: it carries all three
            top_ids_B_T_K[i, :R] = torch.tensor([list(r[:K]) for r in s.top_ids])
            top_behaviour_B_T_K[i, :R] = torch.tensor([list(r[:K]) for r in s.top_logprobs])
            top_teacher_B_T_K[i, :R] = torch.tensor([list(r[:K]) for r in s.teacher_top_logprobs])
    pos_B_L = (attn_B_L.cumsum(-1) - 1).clamp(min=0)
    batch = {
        "input_ids": ids_B_L,
        "attention_mask": attn_B_L,
        "position_ids": pos_B_L,
        "target_B_T": ids_B_L[:, C:],
        "mask_B_T": attn_B_L[:, C:].float(),
        "behaviour_B_T": behaviour_B_T,
        "sampling_B_T": sampling_B_T,
        "teacher_B_T": teacher_B_T,
        "top_ids_B_T_K": top_ids_B_T_K,
        "top_behaviour_B_T_K": top_behaviour_B_T_K,
        "top_teacher_B_T_K": top_teacher_B_T_K,
        "topk_B_T": topk_B_T,
        "distill_B": distill_B,
        "reward_B_T": reward_B_T,
        "bonus_B_T": bonus_B_T,
    }
    return {k: v.to(device) for k, v in batch.items()}


LOGIT_CHUNK_TOKENS = 256  # response positions whose full-vocabulary logits exist at once


def response_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], entropy_grad: bool = False, top_k: bool = False,
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logp_B_T of the response tokens, the full-vocabulary entropy_B_T at those positions and,
    with `top_k`, the logprobs of batch["top_ids_B_T_K"] (else None).

    The model runs without its output head; the head and the log-softmax then run over
    `chunk_tokens` response positions at a time, each chunk under activation checkpointing, so at
    most one chunk's logits (chunk × vocabulary, fp32) exist at once, in the forward and again in
    the backward, instead of B × T × vocabulary for the micro-batch (151,936 columns for Qwen2.5).
    Each position's numbers are those of the unchunked computation. logp = logit[target] −
    logsumexp(logits), which keeps no second log_softmax tensor. The entropy carries a gradient
    only when asked (an entropy bonus); otherwise it is a metric and builds no graph.
    """
    target_B_T = batch["target_B_T"]
    B, T = target_B_T.shape
    base: Any = getattr(model, "get_base_model", lambda: model)()  # PEFT wraps it; a plain model is its own base
    out = base.get_decoder()(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        use_cache=False,
    )
    hidden_N_D = out.last_hidden_state[:, -(T + 1) : -1].reshape(B * T, -1)  # column C−1+t predicts token t
    target_N = target_B_T.reshape(-1)
    top_N_K = batch["top_ids_B_T_K"].reshape(B * T, -1)
    head = base.get_output_embeddings()
    grad = torch.is_grad_enabled()

    def chunk(h_n_D: torch.Tensor, target_n: torch.Tensor, top_n_K: torch.Tensor):
        logits_n_V = head(h_n_D).float()
        lse_n = torch.logsumexp(logits_n_V, dim=-1)
        logp_n = logits_n_V.gather(-1, target_n[:, None]).squeeze(-1) - lse_n
        top_n_k = logits_n_V.gather(-1, top_n_K) - lse_n[:, None] if top_k else lse_n[:0]
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            ent_n = lse_n - (torch.softmax(logits_n_V, dim=-1) * logits_n_V).sum(-1)
        return logp_n, ent_n, top_n_k

    parts = []
    for i in range(0, B * T, chunk_tokens):
        args = (hidden_N_D[i : i + chunk_tokens], target_N[i : i + chunk_tokens], top_N_K[i : i + chunk_tokens])
        parts.append(torch.utils.checkpoint.checkpoint(chunk, *args, use_reentrant=False) if grad else chunk(*args))
    logp_N, ent_N, top_N_k = (torch.cat(x) for x in zip(*parts))
    top_B_T_K = top_N_k.reshape(B, T, -1) if top_k else None
    return logp_N.reshape(B, T), ent_N.reshape(B, T), top_B_T_K


def sample_problem(s: TrainSample, method: str) -> str | None:
    """Why one sample cannot be trained on, or None. The training loop quarantines such samples
    before a step; `train_step` refuses a batch that holds one."""
    R = len(s.response_ids)
    if not s.prompt_ids or not R:
        return "every sample needs a non-empty prompt and response"
    if len(s.behaviour_logprobs) != R:
        return "behaviour_logprobs must have one value per response token"
    loop_from = s.loop_from
    if loop_from is not None and not 0 <= loop_from < R:
        return "loop_from must point into the response"
    if s.teacher_logprobs is None:
        if method == "opd" and loop_from is None:  # a loop row trains without a teacher
            return "method 'opd' needs teacher_logprobs on every sample"
    elif len(s.teacher_logprobs) != R:
        return "teacher_logprobs must have one value per response token"
    return None


def _check(samples: Sequence[TrainSample], cfg: TrainConfig) -> None:
    if not samples:
        raise ValueError("no samples")
    for s in samples:
        problem = sample_problem(s, cfg.method)
        if problem is not None:
            raise ValueError(problem)


def _abs_mean(x_B_T_K: torch.Tensor, rows_B_T: torch.Tensor) -> torch.Tensor:
    """Mean |x| over the K tokens of the positions in rows (0 when there are none)."""
    m = rows_B_T.bool()
    return x_B_T_K.abs().mean(-1)[m].sum() / m.sum().clamp(min=1)


def _clip_frac(batch: dict[str, torch.Tensor], rows_B_T: torch.Tensor, clip: float) -> torch.Tensor:
    """Share of top-K advantages the ±clip bound changed."""
    gap = (batch["top_teacher_B_T_K"] - batch["top_behaviour_B_T_K"]).abs() > clip
    m = rows_B_T.bool()
    return gap.float().mean(-1)[m].sum() / m.sum().clamp(min=1)


def train_step(model: Any, optimizer: torch.optim.Optimizer, samples: Sequence[TrainSample], cfg: TrainConfig,
               before_micro_batch: Callable[[], None] = lambda: None) -> dict[str, float]:
    """`cfg.updates_per_batch` AdamW steps on `samples`; within each, gradients accumulate over
    micro-batches so the update equals the one a single batch of all samples would give. Returns
    the step's metrics. `before_micro_batch` runs before each forward (the trainer yields to
    serving there).

    logp_old is the policy before the first update: the detached logp of the first forward pass
    (no extra pass), kept per micro-batch for the later updates. In the first update the ratio is
    1 and the clip never binds; from the second on it bounds how far the batch pushes each token.
    What corrects for stale samples is the TIS weight of logp_old against the recorded behaviour
    logprobs.

    Metrics, token-weighted means over all updates: loss, clip_low, clip_high, clip_frac, ratio,
    tis, adv, drift, entropy, kl (only when kl_coef > 0: it needs a reference pass), topk_adv and
    topk_clip (top-K OPD), distill_kl (distilled samples); grad_norm (mean over updates); and
    response_len, reward_mean, reward_pos, reward_neg, samples, evidence_rows (positive evidence), loop_rows, updates, tokens,
    pad_frac, micro_batches, step_time_s, tokens_per_s.
    Raises FloatingPointError, with the model and optimizer untouched, if the first update's
    gradient is not finite; a later update with a non-finite gradient is skipped and ends the step
    (`updates` counts the ones applied).
    """
    _check(samples, cfg)
    t0 = time.perf_counter()
    device = next(p for p in model.parameters() if p.requires_grad).device
    w_binary, w_opd = cfg.advantage_weights
    given = samples
    samples = with_evidence(as_loop_rows(samples, cfg.loop_penalty), cfg.evidence_weight if w_opd else 0.0)
    n = len(samples)
    groups = micro_batches(samples, cfg.token_budget(device.type))
    # Per micro-batch, what the later updates reuse: logp_old, its top-K view, the reference logp.
    old: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
    loss_sum = torch.zeros((), device=device)
    metric_sums: dict[str, torch.Tensor] = {}
    grad_norms: list[float] = []
    passes = 0  # forward passes over the batch, a skipped update's included
    was_training = model.training
    model.train()
    try:
        for update in range(cfg.updates_per_batch):
            passes += 1
            optimizer.zero_grad(set_to_none=True)
            for g, group in enumerate(groups):
                before_micro_batch()
                batch = collate(group, device, cfg.opd_top_k if w_opd else 0, cfg.topk_until_nats,
                                cfg.penalty_until_nats)
                use_topk = bool(batch["topk_B_T"].any())
                ref_B_T = None
                if update == 0 and cfg.kl_coef:
                    with torch.no_grad(), model.disable_adapter():
                        ref_B_T, _, _ = response_logprobs(model, batch)
                logp_B_T, ent_B_T, top_B_T_K = response_logprobs(
                    model, batch, entropy_grad=bool(cfg.entropy_coef), top_k=use_topk)
                if update == 0:
                    old.append((logp_B_T.detach(), None if top_B_T_K is None else top_B_T_K.detach(), ref_B_T))
                old_B_T, old_top_B_T_K, ref_B_T = old[g]
                adv_B_T = advantages(
                    batch["reward_B_T"], batch["teacher_B_T"], batch["behaviour_B_T"], batch["mask_B_T"],
                    w_binary=w_binary, w_opd=w_opd, bonus_B_T=batch["bonus_B_T"],
                )
                topk_B_T = None
                k = sum(len(s.response_ids) for s in group)
                if use_topk:
                    assert top_B_T_K is not None  # response_logprobs gathers it when top_k > 0
                    rows_B_T = batch["mask_B_T"] * batch["topk_B_T"]
                    top_adv_B_T_K = topk_advantages(batch["top_teacher_B_T_K"], batch["top_behaviour_B_T_K"],
                                                    rows_B_T, w_opd=w_opd, clip=cfg.opd_clip)
                    topk_B_T = topk_policy_term(top_B_T_K, top_adv_B_T_K, old_top_B_T_K,
                                                clip_low=cfg.clip_low, clip_high=cfg.clip_high)
                    step_metrics = {"topk_adv": _abs_mean(top_adv_B_T_K, rows_B_T),
                                    "topk_clip": _clip_frac(batch, rows_B_T, cfg.opd_clip)}
                    distilled_B_T = rows_B_T * batch["distill_B"][:, None]
                    if cfg.distill_weight and bool(distilled_B_T.any()):
                        kl_B_T = topk_distill_term(top_B_T_K, batch["top_teacher_B_T_K"])
                        topk_B_T = topk_B_T + cfg.distill_weight * torch.where(distilled_B_T.bool(), kl_B_T, 0.0)
                        step_metrics["distill_kl"] = _abs_mean(kl_B_T.detach()[..., None], distilled_B_T)
                    for name, v in step_metrics.items():
                        metric_sums[name] = metric_sums.get(name, 0.0) + v * k
                loss, m = policy_loss(
                    logp_B_T, old_B_T, batch["behaviour_B_T"], adv_B_T, batch["mask_B_T"],
                    clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis_cap=cfg.tis_cap,
                    ref_logp_B_T=ref_B_T, kl_coef=cfg.kl_coef, entropy_B_T=ent_B_T, entropy_coef=cfg.entropy_coef,
                    topk_B_T=topk_B_T, sampling_logp_B_T=batch["sampling_B_T"],
                )
                # The loss is a mean over this micro-batch; weight it by its share of the whole batch.
                share = len(group) / n
                (loss * share).backward()
                loss_sum += loss.detach() * share
                for name, v in m.items():  # token-means -> token-weighted sums
                    metric_sums[name] = metric_sums.get(name, 0.0) + v * k

            params = [p for pg in optimizer.param_groups for p in pg["params"]]
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            if not torch.isfinite(grad_norm):
                if update == 0:  # stepping would write NaN into the adapter; the caller keeps the old version
                    raise FloatingPointError(f"non-finite gradient norm {float(grad_norm)}; step skipped")
                break  # the updates so far are finite: keep them
            optimizer.step()
            grad_norms.append(float(grad_norm))
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.train(was_training)

    n_resp = sum(len(s.response_ids) for s in samples)
    n_tokens = n_resp + sum(len(s.prompt_ids) for s in samples)
    padded = sum(len(g) * (max(len(s.prompt_ids) for s in g) + max(len(s.response_ids) for s in g)) for g in groups)
    rewards = [float(s.reward) for s in given]
    metrics = {name: float(v) / (n_resp * passes) for name, v in metric_sums.items()}  # float() waits for the device
    metrics.update(
        loss=float(loss_sum) / passes,
        clip_frac=metrics["clip_low"] + metrics["clip_high"],
        grad_norm=sum(grad_norms) / len(grad_norms),
        updates=len(grad_norms),
        response_len=n_resp / n,
        reward_mean=sum(rewards) / len(given),
        reward_pos=sum(r > 0 for r in rewards) / len(given),
        reward_neg=sum(r < 0 for r in rewards) / len(given),
        samples=len(given),
        evidence_rows=n - len(given),
        loop_rows=sum(s.loop_from is not None for s in given),
        tokens=n_tokens,  # real prompt + response tokens, padding excluded
        pad_frac=1.0 - n_tokens / padded,
        micro_batches=len(groups),
    )
    elapsed = time.perf_counter() - t0
    metrics.update(step_time_s=elapsed, tokens_per_s=n_tokens * passes / elapsed)
    return metrics
