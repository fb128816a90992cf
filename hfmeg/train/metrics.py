"""Per-step metrics: `metrics.jsonl`, a tqdm bar, the trackers of `report_to` and `loss.png`.

Only the logging rank (global rank 0, which receives the loss from the last
pipeline stage) creates a `MetricsLog`; other ranks log nothing. The trackers (TensorBoard,
MLflow, trackio, W&B: `trackers.py`) get each row under `train/<field>` and `eval/<field>`.
matplotlib is optional: without it there is no `loss.png`.
MoE runs add `expert_load` to each step's row: {MoE layer: [min, max] tokens routed
to one expert} (`models.moe.expert_load`), so a collapsing router shows.

`metrics.jsonl` holds each step once: a run that resumes at step k first drops the rows
after k (steps the previous run took past its last checkpoint, which this run takes
again), so the file and `loss.png` describe one timeline.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..checkpoint.atomic import write_text_atomic
from .trackers import Trackers

METRICS_FILE = "metrics.jsonl"
# epoch: epochs of training data drawn after the step (data.epoch; None for a stream of unknown length)
STEP_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu", "skipped", "epoch")
# An objective's own per-step values (a preference run's `rewards/...`, `logps/...`): `objective` in a row,
# written flat into metrics.jsonl and to the trackers under their names.
OBJECTIVE = "objective"


class MetricsLog:
    def __init__(self, out: Path, total_steps: int, start_step: int = 0, trackers: Trackers | None = None):
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.path = out / METRICS_FILE
        _keep_until(self.path, start_step)
        self._file = self.path.open("a")
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
        self.start_step = start_step
        self.t0 = time.perf_counter()
        self.trackers = trackers

    def log_step(self, row: dict[str, Any]) -> None:
        missing = set(STEP_FIELDS) - set(row)
        if missing:
            raise ValueError(f"metrics row lacks {sorted(missing)}")
        extra = row.pop(OBJECTIVE, {})
        self._file.write(json.dumps({**row, **extra}) + "\n")
        self._file.flush()
        self.bar.update(1)
        mfu = "n/a" if row["mfu"] is None else f"{row['mfu']:.3f}"  # None: device peak unknown (CPU)
        epoch = {} if row["epoch"] is None else {"epoch": f"{row['epoch']:.2f}"}
        self.bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", gnorm=f"{row['grad_norm']:.3f}",
                             tok_s=f"{row['tokens_per_s']:.0f}", mfu=mfu, **epoch)
        if self.trackers is not None:
            values = {f"train/{k}": row[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "epoch")
                      if row[k] is not None}
            values |= {f"train/{k}": v for k, v in extra.items()}
            for layer, (low, high) in row.get("expert_load", {}).items():
                values |= {f"expert_load/layer_{layer}/min": low, f"expert_load/layer_{layer}/max": high}
            self.trackers.log(values, row["step"])

    def log_eval(self, step: int, loss: float | None, objective: dict[str, float] | None = None) -> None:
        """The eval loss (and the objective's own values, e.g. `eval_rewards/accuracies`)."""
        objective = {**({} if loss is None else {"loss": loss}), **(objective or {})}  # None: no eval loss (GRPO)
        self._file.write(json.dumps({"step": step, **{f"eval_{k}": v for k, v in objective.items()}}) + "\n")
        self._file.flush()
        self.bar.write(f"step {step}: eval " + ", ".join(f"{k} {v:.4f}" for k, v in objective.items()))
        if self.trackers is not None:
            self.trackers.log({f"eval/{k}": v for k, v in objective.items()}, step)

    def close(self) -> Path | None:
        self.bar.close()
        self._file.close()
        if self.trackers is not None:
            self.trackers.close()
        return plot_loss(self.path, self.out / "loss.png")


def _keep_until(path: Path, step: int) -> None:
    """Drop the rows of `path` after `step`, and a last line a killed run left half-written."""
    if not path.is_file():
        return
    keep = [line for line in path.read_text().splitlines() if (row := _row(line)) is not None and row["step"] <= step]
    write_text_atomic(path, "".join(line + "\n" for line in keep))


def _row(line: str) -> dict[str, Any] | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def rows_until(path: Path, step: int) -> list[dict[str, Any]]:
    """The rows `path` logged up to `step`, without a last line a killed run left half-written ([] if no file)."""
    lines = path.read_text().splitlines() if path.is_file() else []
    return [row for line in lines if (row := _row(line)) is not None and row["step"] <= step]


def last_losses(path: Path) -> tuple[float | None, float | None, int | None]:
    """The last train loss, and the last eval loss with its step, that `path` logged (None where none)."""
    rows = read_metrics(path) if path.is_file() else []
    train = [r["loss"] for r in rows if "loss" in r]
    evals = [r for r in rows if "eval_loss" in r]
    return (train[-1] if train else None, evals[-1]["eval_loss"] if evals else None,
            evals[-1]["step"] if evals else None)


def plot_loss(metrics: Path, png: Path) -> Path | None:
    """Draw train (and eval) loss against step; None when matplotlib is absent."""
    rows = read_metrics(metrics)
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    return plot_curves([(label, *zip(*points), fmt) for label, points, fmt in
                        (("train loss", train, "-"), ("eval loss", evals, "o-")) if points], png)


def plot_runs(runs: dict[str, list[float]], png: Path, *, mark: tuple[int, str] | None = None) -> Path | None:
    """Draw each named run's per-step losses (steps 1, 2, ...) as `plot_curves` does."""
    return plot_curves([(name, range(1, len(losses) + 1), losses, "-") for name, losses in runs.items()], png,
                       mark=mark)


def plot_curves(curves: list[tuple[str, tuple, tuple, str]], png: Path, *,
                mark: tuple[int, str] | None = None) -> Path | None:
    """Draw (label, steps, losses, matplotlib format) curves, and a dotted line at step `mark`
    (step, label) if given; None when matplotlib is absent or there is nothing to draw (a run that ended
    before its first step)."""
    if not curves:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, steps, losses, fmt in curves:
        ax.plot(steps, losses, fmt, label=label)
    if mark is not None:
        ax.axvline(mark[0], color="grey", linestyle=":", label=mark[1])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(png, dpi=100)
    except OSError as e:  # e.g. a full disk: the curve is a convenience, and must not hide the error that ends a run
        print(f"{png}: not written ({e.strerror or e})", file=sys.stderr, flush=True)
        return None
    finally:
        plt.close(fig)
    return png
