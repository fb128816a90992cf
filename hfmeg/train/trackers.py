"""Experiment trackers: where a run's metrics and config go besides `metrics.jsonl` (`report_to`).

    report_to: [tensorboard, mlflow]        # YAML; `--report-to tensorboard,trackio`; `--report-to none`

Each tracker is its library called directly, a few lines each. accelerate's tracker classes were the first
choice, but they log through accelerate's logger, which refuses to run until an accelerate `PartialState`
exists, and creating one on a CPU rank sets the process's torch threads by accelerate's own rule: hfmeg
shares the cores out itself (`parallel/threads.py`) and its global rank 0 is already the one process that
logs (`MetricsLog`). Every tracker gets the run's config once, flattened to dotted keys (`optim.lr`), and
each step's row under the names TensorBoard shows (`train/loss`, `eval/loss`, ...).

Where each one writes, with no network unless the user points it at a server:
- tensorboard: `<out>/tensorboard` (the config as hparams in `<out>/tensorboard/hparams`); a dependency of
  hfmeg, so on by default;
- mlflow: `MLFLOW_TRACKING_URI` when set, else the SQLite store `<out>/mlflow.db` (MLflow's own default
  backend; its file store now refuses to start), experiment `MLFLOW_EXPERIMENT_NAME` or "hfmeg";
- trackio: its local store (`TRACKIO_DIR`, default `$HF_HOME/trackio`), project "hfmeg", which
  `trackio show` reads;
- wandb: project `WANDB_PROJECT` or "hfmeg", files under `<out>/wandb`; `WANDB_MODE=offline` logs
  without network or login, for `wandb sync` later.
The run is named after `<out>`'s folder. Each session of a run (a resume too) is a tracker run of its own,
from its first step on: unlike `metrics.jsonl`, the trackers keep what a killed session logged past the
checkpoint a resume goes on from.

A tracker whose library is missing is refused by `missing_line` (validation, before anything is written)
with the one line of what to install. The libraries are imported only when a run opens them.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

Tracker = Literal["tensorboard", "wandb", "mlflow", "trackio"]
PROJECT = "hfmeg"
# tracker -> (modules it needs, what to install); mlflow's SQLite store needs sqlalchemy and alembic,
# which the full `mlflow` package brings and mlflow-skinny does not
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard",), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
    "mlflow": (("mlflow",), "mlflow"),
    "trackio": (("trackio",), "trackio"),
}
MLFLOW_SQLITE = (("mlflow", "sqlalchemy", "alembic"), "mlflow")


def _needs(name: str) -> tuple[tuple[str, ...], str]:
    return MLFLOW_SQLITE if name == "mlflow" and not os.environ.get("MLFLOW_TRACKING_URI") else NEEDS[name]


def missing_line(names: list[str]) -> str | None:
    """One line naming what to install for the trackers of `names` whose libraries are absent; None if none."""
    missing = {}
    for name in names:
        modules, package = _needs(name)
        if any(importlib.util.find_spec(m) is None for m in modules):
            missing[name] = package
    if not missing:
        return None
    return (f"report_to: {', '.join(missing)} not installed: pip install {' '.join(sorted(set(missing.values())))} "
            "(or leave it out of report_to)")


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys with values every tracker takes: numbers, booleans and strings (a list or
    None as its text: TensorBoard's hparams refuse them)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (bool, int, float, str)) else str(v)
    return out


class _TensorBoard:
    def __init__(self, out: Path, run_name: str, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(out / "tensorboard"))
        self.writer.add_hparams(config, {}, run_name="hparams")  # TensorBoard's HPARAMS tab

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    def __init__(self, out: Path, run_name: str, config: dict[str, Any]):
        import mlflow
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_PARAMS_TAGS_PER_BATCH

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(f"sqlite:///{(out / 'mlflow.db').resolve()}")
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT))
        mlflow.start_run(run_name=run_name)
        params = [(k, str(v)[:MAX_PARAM_VAL_LENGTH]) for k, v in config.items()]  # one call takes 100 at most
        for i in range(0, len(params), MAX_PARAMS_TAGS_PER_BATCH):
            mlflow.log_params(dict(params[i:i + MAX_PARAMS_TAGS_PER_BATCH]))

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class _Run:
    """A tracker whose `init` gives a run object with `log(values, step=)` and `finish()` (trackio, wandb)."""

    run: Any

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio(_Run):
    def __init__(self, out: Path, run_name: str, config: dict[str, Any]):
        import trackio

        self.run = trackio.init(project=PROJECT, name=run_name, config=config)


class _WandB(_Run):
    def __init__(self, out: Path, run_name: str, config: dict[str, Any]):
        import wandb

        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name, dir=str(out),
                              config=config)


OPENERS = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "trackio": _Trackio, "wandb": _WandB}


class Trackers:
    """The open trackers of a run (on the logging rank): the config at start, then rows of scalars by step."""

    def __init__(self, names: list[str], out: Path, config: dict[str, Any]):
        values = flat_config(config)
        self.trackers = [OPENERS[name](out, out.resolve().name, values) for name in names]

    def log(self, values: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(values, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
