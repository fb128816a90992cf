"""What a run says when it ends: what it did, how it went, and where everything is.

Printed by the logging rank after the final checkpoint (and export), so a user
need not dig through `metrics.jsonl` or `trainer_state.json` to learn the final
loss, how many steps were skipped, what the data pipeline had to drop or cut, or
where the curve, the metrics, the checkpoints and the exported model are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..data import DataReport


def _duration(seconds: float) -> str:
    minutes, s = divmod(round(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m{s:02d}s" if hours else f"{m}m{s:02d}s" if m else f"{s}s"


@dataclass
class RunSummary:
    out: Path
    start_step: int  # the step this session began at (> 0 after a resume)
    step: int
    max_steps: int
    tokens: int = 0  # label tokens trained on in this session
    seconds: float = 0.0
    skipped: int = 0  # optimizer steps skipped for non-finite gradients in this session
    train_loss: float | None = None
    eval_loss: float | None = None
    eval_step: int | None = None
    objective: dict[str, float] = field(default_factory=dict)  # the last step's objective metrics (DPO rewards)
    eval_objective: dict[str, float] = field(default_factory=dict)
    data: DataReport = field(default_factory=DataReport)
    epoch: float | None = None  # epochs of training data drawn by the end (None: a stream of unknown length)
    split: list[tuple[str, int | None, int]] = field(default_factory=list)  # (source, training, held-out records)
    checkpoint: Path | None = None
    hf: Path | None = None
    stopped_by: str | None = None  # the signal that stopped the run early

    def lines(self) -> list[str]:
        ran = self.step - self.start_step
        how = f"stopped by {self.stopped_by} at" if self.stopped_by else "finished:"
        resumed = f", resumed at step {self.start_step}" if self.start_step else ""
        out = [f"run {how} step {self.step}/{self.max_steps}{resumed}; {ran} steps in {_duration(self.seconds)}, "
               f"{self.tokens:,} label tokens, {self.skipped} skipped steps (non-finite gradients)"]
        losses = ["final train loss " + ("n/a" if self.train_loss is None else f"{self.train_loss:.4f}")]
        if self.eval_loss is not None:
            losses.append(f"eval loss {self.eval_loss:.4f} (step {self.eval_step})")
        out.append("  " + ", ".join(losses))
        for label, values in (("last step", self.objective), (f"eval (step {self.eval_step})", self.eval_objective)):
            if values:
                out.append(f"  {label}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))
        out.append(f"  data (whole run): {self.data.documents:,} documents packed"
                   + ("" if self.epoch is None else f", {self.epoch:.2f} epochs of the training records drawn"))
        for name, train, held in self.split:
            size = "a stream" if train is None else f"{train:,} training records"
            out.append(f"  data source {name}: {size}, {held:,} held out for eval (never trained on)")
        for kind, n in sorted(self.data.counts.items()):
            out.append(f"  data problem {kind}: {n:,} records (first: {self.data.first[kind]})")
        for label, path in (("metrics", self.out / "metrics.jsonl"), ("loss curve", self.out / "loss.png"),
                            ("checkpoint", self.checkpoint), ("model", self.hf)):
            if path is not None and path.exists():
                out.append(f"  {label}: {path}")
        return out
