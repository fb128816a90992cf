"""Online RL, GRPO family: advantages from grouped rewards, and the clipped surrogate loss over a `CompletionBatch`.

Settings are TRL's `GRPOConfig`'s, with its names and meanings (`GRPOSettings`).

Advantages (`group_advantages`). Each prompt is sampled G = `num_generations` times; completion i
of a group gets reward r_i = Σ_f w_f r_{f,i} over the reward functions (a None reward is NaN and left
out of the sum; a completion every function left out has no reward: NaN, then advantage 0). With the
group's mean μ and standard deviation σ (Bessel-corrected, NaNs left out): A_i = r_i − μ, divided by
σ + 1e-4 for `scale_rewards` `group`, by the whole batch's σ for `batch`, by nothing for `none`. The
rewards of every data-parallel rank are gathered first, so a group is whole wherever its completions
are trained.

Loss, per completion token t (π: the policy's log-probability of the token, π_old: the policy's before
this step's updates, ρ: the reference's, A: the completion's advantage):
- importance weight w = exp(π − π_old) per token (`importance_sampling_level` token), or GSPO's
  exp(mean over the completion's tokens of π − π_old), one per completion (`sequence`);
- ℓ_t = −min(w' A, clip(w, 1 − ε, 1 + ε_high) A), with w' = min(w, δ) where `delta` (two-sided
  clipping) is set, else w;
- with β = `beta` > 0, plus β k3, k3 = exp(ρ − π) − (ρ − π) − 1, times w where
  `use_bias_correction_kl` (TRL's default; it weighs the KL by the importance weight).

Aggregation (`loss_type`), N the completions and T the completion tokens of the whole step (all
micro-batches, all DP ranks, so the sum of the micro-batch losses is the step's loss, whatever the
layout; TRL computes these per micro-batch, equal with one micro-batch per step):
- `grpo`: the mean over completions of each completion's token mean: Σ_i (Σ_t ℓ_t / n_i) / N;
- `bnpo`, `dapo`: Σ ℓ_t / T (DAPO's token-level normalisation over the whole generation batch; bnpo
  is TRL's per-micro-batch form of the same, here the same number); where one generation batch feeds s
  optimizer steps (`steps_per_generation`), DAPO's T is the generation batch's tokens / s, as TRL rescales
  its `num_items_in_batch`, so the s steps' losses sum to the generation batch's; bnpo's stays the step's;
- `dr_grpo`: Σ ℓ_t / (N × `max_completion_length`).

Context parallelism: each CP rank holds part of every completion's tokens. The per-completion sums (n_i,
GSPO's log-ratio sums) are all-reduced over CP (`all_reduce_cp`, whose backward adds the ranks'
gradients), and a CP rank's loss is its own tokens' share: the CP ranks' losses add up to the step's.

Metrics, TRL's: `kl` (mean of the k3 term over tokens), `clip_ratio/low_mean` (w < 1 − ε with A < 0),
`clip_ratio/high_mean` (w > 1 + ε_high with A > 0), `clip_ratio/region_mean` (either), means over tokens
(token level) or over completions (sequence level); where the generating engine's log-probabilities came
with the completions, the train/generation mismatch `sampling/sampling_logp_difference/mean`, the mean
over tokens of |π − π_generator| (π from this forward, the training layout's); given the policy's chunks,
`entropy`, the mean over completion tokens of the entropy of softmax(logits / T) the tokens are scored with (TRL's
`entropy`; a token mean over the whole step, as `kl` is), from the head's own cross-entropy pass
(`Decoder.record_entropy`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Callable, Literal

import torch
import torch.distributed as dist

from ..data.rollouts import CompletionBatch
from ..errors import LayoutError, UnsupportedConfigError
from ..parallel.comm import all_reduce_cp
from ..parallel.pipeline import forward_backward
from ..plan.rollout import VLLM_GPU_MEMORY_UTILIZATION, grpo_terms
from .dataclass_io import ConfigError

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
MISMATCH = "sampling/sampling_logp_difference/mean"  # TRL's name: mean |π_train − π_generator| over tokens
ENTROPY = "entropy"
CARD_METRICS = ("reward", "reward_std", "kl")  # what a model card shows of the last step, beside the loss


@dataclass
class GRPOSettings:
    """The GRPO objective and its sampling, as TRL's `GRPOConfig` names them (defaults TRL's). A run is a GRPO run
    when it names reward functions (`rewards.py`)."""

    reward_funcs: list[str] = field(default_factory=list)  # built-in names or module:function
    generator: Literal["transformers", "vllm"] = "transformers"
    loss_type: LossType = "dapo"
    beta: float = 0.0  # weight of the KL to the reference; 0: no reference is held
    epsilon: float = 0.2
    epsilon_high: float | None = None  # None: epsilon
    delta: float | None = None  # two-sided clipping's upper bound on the importance weight
    scale_rewards: Literal["group", "batch", "none"] = "group"
    importance_sampling_level: Literal["token", "sequence"] = "token"
    use_bias_correction_kl: bool = True
    num_generations: int = 8
    num_iterations: int = 1  # passes over each generation batch; > 1: π_old from a training forward
    # One generation batch feeding several optimizer steps (TRL's names; set one of the two, TRL refuses both):
    # `generation_batch_size` completions generated at once, a multiple of train.global_batch_size, or
    # `steps_per_generation` optimizer steps per generation. TRL counts the latter in its gradient-accumulation
    # steps (default gradient_accumulation_steps: one optimizer step); hfmeg's step is the whole global batch on any
    # layout, so it counts optimizer steps: TRL's steps_per_generation / gradient_accumulation_steps. None: one step.
    generation_batch_size: int | None = None
    steps_per_generation: int | None = None
    max_completion_length: int = 256
    mask_truncated_completions: bool = False
    reward_weights: list[float] | None = None  # None: 1 for each reward function
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # the vLLM engine on a GPU: the share of its memory vLLM reserves for all it holds (TRL's colocated-vLLM setting
    # and default; vLLM's own default, 0.9, would leave the training ranks a tenth); on a CPU host it is given its KV
    # cache instead (VLLM_CPU_KVCACHE_SPACE)
    vllm_gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION

    def __post_init__(self) -> None:
        if self.generator not in ("transformers", "vllm"):
            raise ConfigError(f"grpo.generator must be transformers or vllm, got {self.generator!r}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(f"grpo.vllm_gpu_memory_utilization must be in (0, 1], got "
                              f"{self.vllm_gpu_memory_utilization}")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ConfigError(f"grpo.reward_weights: {len(self.reward_weights)} weights for "
                              f"{len(self.reward_funcs)} reward functions")
        if self.loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo"):
            raise ConfigError(f"grpo.loss_type must be grpo, bnpo, dr_grpo or dapo, got {self.loss_type!r}")
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ConfigError(f"grpo.scale_rewards must be group, batch or none, got {self.scale_rewards!r}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ConfigError("grpo.importance_sampling_level must be token or sequence, got "
                              f"{self.importance_sampling_level!r}")
        if self.beta < 0:
            raise ConfigError(f"grpo.beta must be >= 0, got {self.beta}")
        if not 0 <= self.epsilon < 1 or (self.epsilon_high is not None and self.epsilon_high < 0):
            raise ConfigError(f"grpo.epsilon must be in [0, 1) and epsilon_high >= 0, got {self.epsilon}, "
                              f"{self.epsilon_high}")
        if self.delta is not None and not self.delta > 0:  # TRL recommends > 1 + epsilon_high
            raise ConfigError(f"grpo.delta must be > 0, got {self.delta}")
        if self.num_generations < 2:
            raise ConfigError(f"grpo.num_generations must be >= 2 (a group's advantages need two completions), "
                              f"got {self.num_generations}")
        if self.num_iterations < 1 or self.max_completion_length < 1:
            raise ConfigError("grpo.num_iterations and grpo.max_completion_length must be >= 1")
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ConfigError(f"grpo.generation_batch_size {self.generation_batch_size} and grpo.steps_per_generation "
                              f"{self.steps_per_generation}: set one of them (the other follows from "
                              "train.global_batch_size)")
        if any(v is not None and v < 1 for v in (self.generation_batch_size, self.steps_per_generation)):
            raise ConfigError(f"grpo.generation_batch_size and grpo.steps_per_generation must be >= 1, got "
                              f"{self.generation_batch_size}, {self.steps_per_generation}")
        if not self.temperature > 0:  # sampling: the training log-probabilities are of softmax(logits / T)
            raise ConfigError(f"grpo.temperature must be > 0, got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ConfigError(f"grpo.top_k must be >= 0 (0: off) and grpo.top_p in (0, 1], got {self.top_k}, "
                              f"{self.top_p}")

    @property
    def enabled(self) -> bool:
        return bool(self.reward_funcs)

    tag = "grpo"  # a model card's tag (TRL's for its GRPOTrainer)

    def describe(self, adapters: bool) -> str:
        """The objective in words, for a model card (`adapters`: a LoRA/DoRA run)."""
        ratio = ", sequence-level importance ratios (GSPO)" if self.importance_sampling_level == "sequence" else ""
        kl = (f"k3 KL weight {self.beta:g} against " + ("the base with the adapters off" if adapters else
                                                        "a frozen copy of the base")) if self.beta else "no KL term"
        engine = "a vLLM engine" if self.generator == "vllm" else "the in-process transformers engine"
        return (f"online RL, GRPO family ({self.loss_type} loss{ratio}, clip epsilon {self.epsilon:g}/{self.eps_high:g}"
                f", {kl}), {self.num_generations} completions per prompt scored by {', '.join(self.reward_funcs)}, "
                f"generated by {engine}")

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_reference(self) -> bool:
        return self.beta != 0.0

    def planner_terms(self, adapters: bool, global_batch_size: int, seq_len: int) -> dict:
        """What the planner counts of a GRPO run (`plan.search.Job`'s fields, plan/rollout.py): the reference (beta >
        0) and the rollouts' engine and export folder."""
        return grpo_terms(generator=self.generator, beta=self.beta, adapters=adapters,
                          global_batch_size=global_batch_size,
                          generation_steps=self.generation_steps(global_batch_size), seq_len=seq_len,
                          max_completion_length=self.max_completion_length,
                          vllm_gpu_memory_utilization=self.vllm_gpu_memory_utilization)

    def generation_steps(self, global_batch_size: int) -> int:
        """Optimizer steps one generation batch feeds (check_config refuses a generation batch of no whole steps)."""
        if self.generation_batch_size is not None:
            return self.generation_batch_size // global_batch_size
        return self.steps_per_generation or 1


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Standard deviation with NaNs left out, Bessel-corrected (NaN for fewer than two values), as TRL's."""
    keep = ~torch.isnan(x)
    n = keep.sum() if dim is None else keep.sum(dim)
    mean = torch.nanmean(x) if dim is None else torch.nanmean(x, dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2) if dim is None else torch.nanmean((x - mean) ** 2, dim)
    return torch.where(n > 1, (var * n / (n - 1)).sqrt(), torch.full_like(var, float("nan")))


def group_advantages(rewards: torch.Tensor, weights: torch.Tensor, cfg: GRPOSettings,
                     names: list[str]) -> tuple[torch.Tensor, dict[str, float]]:
    """Each completion's advantage `[N]` from the rewards `[N, functions]` (NaN: the function gave None) of a whole
    generation batch, groups of `num_generations` consecutive completions; and TRL's reward metrics."""
    g = cfg.num_generations
    if rewards.shape[0] % g:
        raise LayoutError(f"{rewards.shape[0]} completions are not whole groups of num_generations {g}")
    total = weighted_total(rewards, weights)
    grouped = total.view(-1, g)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(g)
    std = nanstd(grouped, dim=1).repeat_interleave(g) if cfg.scale_rewards != "batch" else nanstd(total).expand_as(total)
    advantages = total - mean
    if cfg.scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    metrics = reward_metrics(rewards, total, names)
    metrics["frac_reward_zero_std"] = float(torch.isclose(std, torch.zeros_like(std)).float().mean())
    return torch.nan_to_num(advantages, nan=0.0), metrics


def weighted_total(rewards: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward `[N]`: Σ_f w_f r_f over the functions that scored it (NaN: none did)."""
    total = (rewards * weights).nansum(dim=1)
    total[torch.isnan(rewards).all(dim=1)] = float("nan")
    return total


def reward_metrics(rewards: torch.Tensor, total: torch.Tensor, names: list[str]) -> dict[str, float]:
    """TRL's `rewards/<func>/mean`, `reward` and `reward_std` of the rewards `[N, functions]` and their totals."""
    metrics = {f"rewards/{name}/mean": float(torch.nanmean(rewards[:, i])) for i, name in enumerate(names)}
    metrics.update(reward=float(torch.nanmean(total)), reward_std=float(nanstd(total)))
    return metrics


class GRPOLoss:
    """The `MicroBatchLoss` of a GRPO step (module doc). `num_completions`, `num_tokens`: the step's completions and
    completion tokens that count (all micro-batches, all DP ranks). `chunks`: this rank's policy chunks, whose head
    then keeps each token's entropy for the `entropy` metric (None: no such metric). `totals` sums this rank's
    metric numerators and denominators over its micro-batches (complete over CP), detached. `dapo_tokens`: DAPO's
    normaliser where it is not `num_tokens` (a generation batch's tokens / the steps it feeds, module doc)."""

    def __init__(self, cfg: GRPOSettings, ps, num_completions: int, num_tokens: int, chunks=None,
                 dapo_tokens: float | None = None):
        if num_completions < 1:
            raise LayoutError(f"a GRPO step needs at least one completion, got {num_completions}")
        self.cfg, self.ps = cfg, ps
        self.num_completions, self.num_tokens = num_completions, max(num_tokens, 1)
        self.dapo_tokens = self.num_tokens if dapo_tokens is None else dapo_tokens
        self.scores_entropy = chunks is not None
        self.head = next((c for c in chunks or () if c.post_process), None)
        if self.head is not None:
            self.head.record_entropy = True
        # kl sum, tokens, |π − π_gen| sum, its tokens, entropy sum; low, high, region (clip numerators), clip
        # denominator
        self.totals = torch.zeros(9, dtype=torch.float64, device=ps.device)

    def __call__(self, per_token: torch.Tensor, mb: CompletionBatch) -> torch.Tensor:
        cfg, ps = self.cfg, self.ps
        ids = mb.sequence_ids
        kept = ids >= 0
        seq = ids[kept]
        logp = -per_token[kept]
        n = mb.num_completions
        counts = logp.new_zeros(n).index_add_(0, seq, torch.ones_like(logp))
        if ps.cp > 1:
            dist.all_reduce(counts, group=ps.cp_group)
        old = logp.detach() if mb.old_logps is None else mb.old_logps[kept]
        adv = mb.advantages.to(logp.dtype)
        if cfg.importance_sampling_level == "sequence":
            seq_ratio = logp.new_zeros(n).index_add(0, seq, logp - old)
            if ps.cp > 1:
                seq_ratio = all_reduce_cp(seq_ratio, ps)
            weight_seq = torch.exp(seq_ratio / counts.clamp(min=1))
            weight = weight_seq[seq]
        else:
            weight = torch.exp(logp - old)
        a = adv[seq]
        clipped = torch.clamp(weight, 1 - cfg.epsilon, 1 + cfg.eps_high)
        capped = weight if cfg.delta is None else torch.clamp(weight, max=cfg.delta)
        loss_t = -torch.min(capped * a, clipped * a)
        kl = None
        if cfg.beta:
            if mb.ref_logps is None:
                raise LayoutError("grpo.beta > 0: the micro-batch has no reference log-probabilities")
            d = mb.ref_logps[kept] - logp
            kl = torch.exp(d) - d - 1
            if cfg.use_bias_correction_kl:
                kl = kl * weight
            loss_t = loss_t + cfg.beta * kl
        if cfg.loss_type == "grpo":
            loss = (loss_t / counts[seq]).sum() / self.num_completions
        elif cfg.loss_type == "dr_grpo":
            loss = loss_t.sum() / (self.num_completions * cfg.max_completion_length)
        elif cfg.loss_type == "dapo":
            loss = loss_t.sum() / self.dapo_tokens
        else:  # bnpo
            loss = loss_t.sum() / self.num_tokens
        gen = None if mb.gen_logps is None else mb.gen_logps[kept]
        entropy = self.head.take_entropy()[kept] if self.head is not None else None
        if cfg.importance_sampling_level == "sequence":
            self._add_metrics(kl, logp, gen, entropy, weight_seq.detach(), adv, per_sequence=True,
                              capped_seq=cfg.delta)
        else:
            self._add_metrics(kl, logp, gen, entropy, capped.detach(), a, per_sequence=False)
        return loss

    def _add_metrics(self, kl, logp, gen, entropy, weight, adv, per_sequence: bool, capped_seq=None) -> None:
        cfg = self.cfg
        if capped_seq is not None:
            weight = weight.clamp(max=capped_seq)
        low = (weight < 1 - cfg.epsilon) & (adv < 0)
        high = (weight > 1 + cfg.eps_high) & (adv > 0)
        zero = logp.new_zeros(())
        tokens = torch.stack([kl.detach().sum() if kl is not None else zero, logp.new_tensor(float(logp.numel())),
                              (logp.detach() - gen).abs().sum() if gen is not None else zero,
                              logp.new_tensor(float(logp.numel() if gen is not None else 0)),
                              entropy.sum() if entropy is not None else zero]).double()
        clips = torch.stack([low.sum(), high.sum(), (low | high).sum()]).double()
        clip_den = torch.tensor([float(weight.numel())], dtype=torch.float64, device=clips.device)
        if self.ps.cp > 1:  # token sums are this rank's share; sequence-level values are whole on every CP rank
            dist.all_reduce(tokens, group=self.ps.cp_group)
            if not per_sequence:
                clips = torch.cat([clips, clip_den])
                dist.all_reduce(clips, group=self.ps.cp_group)
                clips, clip_den = clips[:3], clips[3:]
        self.totals += torch.cat([tokens, clips, clip_den])

    def metrics(self, totals) -> dict[str, float]:
        """The step's metrics from `totals` summed over the ranks that hold distinct completions."""
        kl, tokens, mismatch, compared, entropy, low, high, region, den = (float(v) for v in totals)
        out = {"clip_ratio/low_mean": low / max(den, 1), "clip_ratio/high_mean": high / max(den, 1),
               "clip_ratio/region_mean": region / max(den, 1)}
        if self.cfg.beta:
            out["kl"] = kl / max(tokens, 1)
        if compared:
            out[MISMATCH] = mismatch / compared
        if self.scores_entropy:
            out[ENTROPY] = entropy / max(tokens, 1)
        return out


class _TokenLogps:
    """A forward-only `MicroBatchLoss` that keeps each micro-batch's per-token log-probabilities `[b, s]` (0 where no
    label counts), in order."""

    def __init__(self):
        self.out: list[torch.Tensor] = []

    def __call__(self, per_token: torch.Tensor, mb: CompletionBatch) -> torch.Tensor:
        self.out.append(-per_token.detach().float())
        return per_token.new_zeros(())


@torch.no_grad()
def set_temperature(chunks, temperature: float) -> None:
    """The head of `chunks` (policy or reference) scores log-probabilities of softmax(logits / temperature), those
    the engine sampled from (TRL divides its training logits by the sampling temperature too). A soft-capped head
    caps the logits before any division, which the scaled input of `_head` would not reproduce: refused."""
    for chunk in chunks:
        if chunk.post_process:
            if temperature != 1.0 and chunk.cfg.final_softcap is not None:
                raise UnsupportedConfigError(f"grpo.temperature {temperature}: the model soft-caps its logits; "
                                             "only temperature 1 is supported for it")
            chunk.logit_temperature = temperature


def annotate_logps(chunks, mbs: list[CompletionBatch], ps, schedule: str, field: str,
                   switched: Callable[[], AbstractContextManager] = nullcontext) -> list[CompletionBatch]:
    """`mbs` with `field` (`ref_logps` or `old_logps`) filled on the last pipeline stage from a forward-only pass of
    `chunks` (inside `switched()`: the reference's adapters switched off) through the step's pipeline schedule."""
    logps = _TokenLogps()
    with switched():
        forward_backward(chunks, ps, mbs, schedule=schedule, loss=logps, forward_only=True, sync_loss=False)
    if not ps.is_last_stage:
        return mbs
    return [replace(mb, **{field: t}) for mb, t in zip(mbs, logps.out, strict=True)]


def check_config(cfg) -> None:
    """What a GRPO run (`cfg.grpo.enabled`) refuses before anything is written, naming the field; the reward functions
    are imported here, so one that cannot be is refused too."""
    g = cfg.grpo
    if not g.enabled:
        return
    from .rewards import resolve

    if cfg.preference.enabled:
        raise ConfigError(f"preference.loss_type {cfg.preference.loss_type}: a GRPO run (grpo.reward_funcs) has its own "
                          "loss; set preference.loss_type none")
    if len(cfg.data.sources) != 1:
        raise ConfigError(f"data.sources: a GRPO run reads its prompts from one source, got {len(cfg.data.sources)}")
    if cfg.train.global_batch_size % g.num_generations:
        raise ConfigError(f"grpo.num_generations {g.num_generations} does not divide train.global_batch_size "
                          f"{cfg.train.global_batch_size} (the generation batch: completions per step)")
    if g.generation_batch_size is not None and g.generation_batch_size % cfg.train.global_batch_size:
        raise ConfigError(f"grpo.generation_batch_size {g.generation_batch_size} is not a multiple of "
                          f"train.global_batch_size {cfg.train.global_batch_size} (the completions of one optimizer "
                          "step)")
    if g.max_completion_length >= cfg.data.seq_len:
        raise ConfigError(f"grpo.max_completion_length {g.max_completion_length} leaves no room for a prompt in "
                          f"data.seq_len {cfg.data.seq_len}")
    if g.needs_reference and cfg.peft.enabled and (cfg.peft.init_from or cfg.peft.modules_to_save):
        # as for DPO: a LoRA run's reference is the base with the adapters off, where fresh adapters start
        raise ConfigError("peft.init_from / peft.modules_to_save: grpo.beta > 0 measures the policy against the base "
                          "with the adapters off, which is not where these start; merge first or set grpo.beta 0")
    for name in g.reward_funcs:
        resolve(name)
    if g.generator == "vllm":
        from ..generation.vllm_engine import vllm_python

        vllm_python()  # its environment is there (else the line says how to make it)
