"""The trainer of a GRPO run (`grpo.reward_funcs` set): the SFT/DPO loop with rollouts for data and the GRPO loss.

What differs from `Trainer` is three answers: the batches come from `rollout.Rollouts` (generated from
the current weights each step, scored, with advantages); a batch's loss is `grpo.GRPOLoss`, which also
carries the generation's metrics (rewards, completion lengths) into the logged ones; and with `grpo.beta`
> 0 the reference (a frozen copy for full fine-tuning, the base with the adapters off for LoRA, as for
DPO: parts/reference.py) fills each completion token's reference log-probability forward-only before
the policy's pass. Checkpoints, resume (the prompt cursor is the data state; a checkpoint inside a
generation batch also keeps the batch: rollout_checkpoint.py), export and the card are the loop's own.
"""

from __future__ import annotations

from .grpo import GRPOLoss, annotate_logps, set_temperature
from .rollout import Rollouts
from .trainer import Trainer


class TokenReference:
    """The reference of a GRPO run: per-token log-probabilities of the completions (`CompletionBatch.ref_logps`)."""

    def __init__(self, reference):
        self.reference = reference

    def annotate(self, mbs, ps, schedule: str, key):
        return annotate_logps(self.reference.chunks, mbs, ps, schedule, "ref_logps", self.reference.switched)


class _Loss(GRPOLoss):
    """The GRPO loss of a step, its metrics with the step's generation metrics beside them."""

    def __init__(self, cfg, ps, batch, chunks):
        super().__init__(cfg, ps, batch.num_completions, batch.num_tokens, chunks, batch.dapo_tokens)
        self.generation = batch.metrics

    def metrics(self, totals) -> dict[str, float]:
        return {**self.generation, **super().metrics(totals)}


class GRPOTrainer(Trainer):
    """`engine`: a generation engine (generation/engine.py) rank 0 generates with instead of starting its own
    (`grpo.generator`'s); the caller keeps and closes it (one vLLM engine serving several runs in turn)."""

    def __init__(self, cfg, engine=None):
        self.given_engine = engine
        super().__init__(cfg)

    def _build_data(self):
        return Rollouts(self.cfg, self.ps, self.tokenizer, lambda: self.chunks, self.part, self.checkpoints.hf_source,
                        self.out, self.schedule, engine=self.given_engine, resume_dir=self.resume_dir)

    def _write_data(self, folder):
        self.data.write_checkpoint(folder)

    def _objective(self, batch):
        return _Loss(self.cfg.grpo, self.ps, batch, self.chunks)

    def evaluate(self) -> tuple[None, dict[str, float]]:
        """No eval loss: the held-out prompts' greedy completions, scored (`Rollouts.evaluate`)."""
        return None, self.data.evaluate()

    def _reference(self):
        """The reference (built after the policy's chunks): both heads score at the sampling temperature."""
        set_temperature(self.chunks, self.cfg.grpo.temperature)
        if not self.cfg.grpo.needs_reference:
            return None
        reference = self.part.reference(self.chunks)
        set_temperature(reference.chunks, self.cfg.grpo.temperature)
        return TokenReference(reference)
