"""Preference tuning: DPO and its variants, as a loss over the pairs of a `PairBatch`.

For pair p with chosen sequence c and rejected sequence r (prompt + answer each), the policy's
log-probability of an answer is the sum of log p(token) over its answer tokens: the per-token
losses the last chunk returns, negated and summed by `PairBatch.sequence_ids` (π_c, π_r), over
n_c, n_r tokens; the reference's are `PairBatch.ref_logps` (ρ_c, ρ_r). With β = `beta`,
ε = `label_smoothing`, and the per-pair loss named as TRL names it (`loss_type`):

- `sigmoid` (DPO; with ε > 0 conservative DPO): d = (π_c − ρ_c) − (π_r − ρ_r),
  ℓ = −(1 − ε) log σ(β d) − ε log σ(−β d);
- `ipo`: the log-ratios averaged over each answer's tokens (TRL's DPOTrainer normalises IPO's
  sums by the answer lengths), d = (π_c − ρ_c) / n_c − (π_r − ρ_r) / n_r, ℓ = (d − 1 / (2β))²;
- `simpo` (reference-free; TRL's CPO trainer with loss_type simpo): d = π_c / n_c − π_r / n_r − γ / β,
  ℓ as for sigmoid.

`rpo_alpha` α adds α times the mean negative log-likelihood of the chosen answers' tokens (TRL:
the `sft` term of a DPO loss list with weight α; the CPO trainer's `cpo_alpha`).

The loss of a global batch is the mean of ℓ over its pairs plus α · (−Σ chosen tokens' log p) /
(chosen tokens), so a micro-batch contributes Σ_p ℓ_p / `num_pairs` + α (−Σ π_c) / `chosen_tokens`
with both counts the global batch's (`StepBatch`), and its micro-batch losses add up over
micro-batches and DP ranks as the next-token loss's do (parallel/pipeline.py). TRL takes each term's
mean per batch; with one micro-batch and DP = 1 the two are the same number.

Context parallelism: each CP rank holds part of every sequence's tokens, so it sums its part and
the CP ranks add their sums (`all_reduce_cp`, whose backward adds the ranks' gradients); every
CP rank then computes the same loss, and contributes it divided by CP (the logged and the
back-propagated losses then add up over CP as the next-token loss's halves do).

The metrics are TRL's (`rewards/chosen`, `rewards/rejected`, `rewards/accuracies`, `rewards/margins`,
`logps/chosen`, `logps/rejected`), means over the global batch's pairs: a reward is β (π − ρ) (simpo:
β π / n), `logps` are π (simpo: π / n), an accuracy is whether the chosen reward is the larger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..data.microbatch import PairBatch
from ..errors import LayoutError
from ..parallel.comm import all_reduce_cp
from .dataclass_io import ConfigError

LossType = Literal["none", "sigmoid", "ipo", "simpo"]
# Each loss type's usual name (a model card's tag) and its name in words.
NAMES = {"sigmoid": ("dpo", "DPO (sigmoid loss)"), "ipo": ("ipo", "IPO"), "simpo": ("simpo", "SimPO")}
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected")


@dataclass
class PreferenceConfig:
    """The preference objective (`loss_type` none: next-token training, SFT or pretraining)."""

    loss_type: LossType = "none"
    beta: float = 0.1
    label_smoothing: float = 0.0  # sigmoid and simpo: the probability that a pair's labels are flipped
    rpo_alpha: float = 0.0  # weight of the chosen answers' NLL; 0: none
    simpo_gamma: float = 0.5  # simpo's target reward margin γ
    # live: the reference's forward runs each step; precomputed: in one pass over the run's batches before the
    # first step, then the reference is dropped (parts/reference.py)
    reference: Literal["live", "precomputed"] = "live"

    def __post_init__(self) -> None:
        if self.loss_type == "none":
            return
        if not self.beta > 0:
            raise ConfigError(f"preference.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"preference.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type == "ipo":
            raise ConfigError("preference.label_smoothing: ipo has no label smoothing (sigmoid and simpo have)")
        if self.rpo_alpha < 0:
            raise ConfigError(f"preference.rpo_alpha must be >= 0, got {self.rpo_alpha}")

    @property
    def enabled(self) -> bool:
        return self.loss_type != "none"

    @property
    def needs_reference(self) -> bool:
        return self.loss_type in ("sigmoid", "ipo")

    def planner_terms(self, adapters: bool) -> dict[str, bool]:
        """What the planner counts of the reference (`plan.search.Job`): a live one runs forward each step, and
        full fine-tuning holds it as a frozen copy; a precomputed one ran before training and is gone."""
        live = self.needs_reference and self.reference == "live"
        return dict(reference_forward=live, reference_copy=live and not adapters)

    @property
    def tag(self) -> str | None:
        """The method's usual name (a model card's tag): dpo, ipo, simpo."""
        return NAMES[self.loss_type][0] if self.enabled else None

    def describe(self, adapters: bool) -> str:
        """The objective in words, for a model card (`adapters`: a LoRA/DoRA run)."""
        name = NAMES[self.loss_type][1]
        extras = [f"beta {self.beta:g}"]
        if self.loss_type == "simpo":
            extras.append(f"gamma {self.simpo_gamma:g}")
        if self.label_smoothing:
            extras.append(f"label smoothing {self.label_smoothing:g}")
        if self.rpo_alpha:
            extras.append(f"NLL of the chosen answers weighted {self.rpo_alpha:g}")
        reference = ("reference-free" if not self.needs_reference else
                     "against the base with the adapters off" if adapters else "against a frozen copy of the base")
        return f"{name}, {', '.join(extras)}, {reference}, on preference pairs"


def sequence_logps(per_token: torch.Tensor, mb: PairBatch, ps) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's log-probability `[2 * num_pairs]` (differentiable) and answer-token count, summed over this
    rank's tokens and then over the CP ranks."""
    ids = mb.sequence_ids
    kept = ids >= 0
    n = 2 * mb.num_pairs
    logps = per_token.new_zeros(n).index_add(0, ids[kept], -per_token[kept])
    counts = per_token.new_zeros(n).index_add_(0, ids[kept], torch.ones_like(per_token[kept]))
    if ps.cp > 1:
        logps = all_reduce_cp(logps, ps)
        counts = all_reduce_cp(counts, ps)
    return logps, counts


class PreferenceLoss:
    """The `MicroBatchLoss` of a preference step (module doc); `totals` sums the step's metrics over this rank's
    micro-batches (`METRICS` order), detached."""

    def __init__(self, cfg: PreferenceConfig, ps, num_pairs: int, chosen_tokens: int):
        if num_pairs < 1:
            raise LayoutError(f"a preference step needs at least one pair, got {num_pairs}")
        self.cfg, self.ps = cfg, ps
        self.num_pairs, self.chosen_tokens = num_pairs, max(chosen_tokens, 1)
        self.totals = torch.zeros(len(METRICS), dtype=torch.float64, device=ps.device)

    def __call__(self, per_token: torch.Tensor, mb: PairBatch) -> torch.Tensor:
        cfg = self.cfg
        logps, counts = sequence_logps(per_token, mb, self.ps)
        if cfg.loss_type == "simpo":
            scores = logps / counts.clamp(min=1)
            rewards = cfg.beta * scores
            d = scores[0::2] - scores[1::2] - cfg.simpo_gamma / cfg.beta
        else:
            if mb.ref_logps is None:
                raise LayoutError(f"preference.loss_type {cfg.loss_type}: the micro-batch has no reference "
                                  "log-probabilities")
            ratios = logps - mb.ref_logps
            rewards = cfg.beta * ratios
            scores = ratios / counts.clamp(min=1) if cfg.loss_type == "ipo" else ratios
            d = scores[0::2] - scores[1::2]
        if cfg.loss_type == "ipo":
            per_pair = (d - 1 / (2 * cfg.beta)) ** 2
        else:
            eps = cfg.label_smoothing
            per_pair = -(1 - eps) * F.logsigmoid(cfg.beta * d) - eps * F.logsigmoid(-cfg.beta * d)
        loss = per_pair.sum() / self.num_pairs
        if cfg.rpo_alpha:
            loss = loss + cfg.rpo_alpha * -logps[0::2].sum() / self.chosen_tokens
        self._add_metrics(rewards.detach(), (scores if cfg.loss_type == "simpo" else logps).detach())
        return loss / self.ps.cp

    def _add_metrics(self, rewards: torch.Tensor, logps: torch.Tensor) -> None:
        rc, rr = rewards[0::2], rewards[1::2]
        values = (rc.sum(), rr.sum(), (rc > rr).sum(), (rc - rr).sum(), logps[0::2].sum(), logps[1::2].sum())
        self.totals += torch.stack([v.double() for v in values])

    def metrics(self, totals) -> dict[str, float]:
        """The global batch's means from `totals` (a sequence of numbers) summed over the ranks that hold distinct
        pairs."""
        return {name: float(v) / self.num_pairs for name, v in zip(METRICS, totals)}
