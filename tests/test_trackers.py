"""Trackers (`report_to`, hfmeg/train/trackers.py): TensorBoard, MLflow and trackio, offline and local, hold the
run's own loss series and config, written by rank 0 alone; a tracker whose library is absent is one line, exit 2,
before anything is written.

The run: stories260K on alpaca at TP2 (two gloo ranks, so that a second writer would show), 4 steps, an eval at
steps 2 and 4 on a held-out split. The loss each tracker holds is compared with `metrics.jsonl`'s exactly:
MLflow and trackio store the Python float (float64), TensorBoard's event file a float32, so there the series
is compared with the float32 rounding of each value.
"""

from __future__ import annotations

import importlib.util
import sys

import numpy as np
import pytest

from hfmeg.parallel.launch import spawn
from hfmeg.train.cli import train_command
from hfmeg.train.config import train_config
from hfmeg.train.metrics import read_metrics
from hfmeg.train.trainer import Trainer
from test_train import ALPACA, _assets, _config


def _run(cfg):
    return Trainer(cfg).run().is_logger


def _series(rows: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if key in r]


def test_tensorboard_mlflow_and_trackio_hold_the_runs_losses_and_config(tmp_path, monkeypatch):
    model = _assets()
    trackio_dir = tmp_path / "trackio"
    # trackio reads TRACKIO_DIR once, at its import, and its modules bind the path by name: an earlier test of the
    # session may have imported it already. So it is imported here, before the ranks fork, and each binding is set
    # (the environment too, for ranks started by spawn rather than fork).
    monkeypatch.setenv("TRACKIO_DIR", str(trackio_dir))
    import trackio  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name.startswith("trackio") and hasattr(module, "TRACKIO_DIR"):
            monkeypatch.setattr(module, "TRACKIO_DIR", trackio_dir)
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "tracked"
    cfg = _config(out, model, tp=2, steps=4, gbs=4, eval_every=2, eval_split=16)
    cfg.report_to = ["tensorboard", "mlflow", "trackio"]
    spawn(_run, 2, cfg)
    rows = read_metrics(out / "metrics.jsonl")
    losses, evals = _series(rows, "loss"), _series(rows, "eval_loss")
    assert [s for s, _ in losses] == [1, 2, 3, 4] and [s for s, _ in evals] == [2, 4]

    # MLflow: the SQLite store in <out>, one run (rank 0's), the losses and the config's values as params
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "hfmeg"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked"
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
               for key in ("train/loss", "eval/loss")}
    assert history == {"train/loss": losses, "eval/loss": evals}
    assert run.data.params["optim.lr"] == str(cfg.optim.lr) and run.data.params["parallel.tp"] == "2"

    # trackio: its local store under TRACKIO_DIR, project hfmeg, one run
    import trackio.utils
    from trackio.sqlite_storage import SQLiteStorage

    assert trackio.utils.TRACKIO_DIR == trackio_dir
    assert SQLiteStorage.get_runs("hfmeg") == ["tracked"]
    logs = SQLiteStorage.get_logs("hfmeg", "tracked")
    assert [(r["step"], r["train/loss"]) for r in logs if "train/loss" in r] == losses
    assert [(r["step"], r["eval/loss"]) for r in logs if "eval/loss" in r] == evals
    config = SQLiteStorage.get_run_config("hfmeg", "tracked")
    assert config["optim.lr"] == cfg.optim.lr and config["data.seq_len"] == 64

    # TensorBoard: <out>/tensorboard, float32 scalars; the config as hparams in <out>/tensorboard/hparams
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    for key, series in (("train/loss", losses), ("eval/loss", evals)):
        assert [(e.step, e.value) for e in events.Scalars(key)] == [(s, float(np.float32(v))) for s, v in series]
    hparams = EventAccumulator(str(out / "tensorboard" / "hparams")).Reload().PluginTagToContent("hparams")
    session = metadata.parse_session_start_info_plugin_data(hparams[metadata.SESSION_START_INFO_TAG])
    assert session.hparams["optim.lr"].number_value == cfg.optim.lr
    assert session.hparams["model.dtype"].string_value == "fp32"


@pytest.mark.parametrize("report_to, line", [
    ("tensorboard,trackio", "report_to: trackio not installed: pip install trackio (or leave it out of report_to)"),
    ("mlflow,wandb", "report_to: mlflow, wandb not installed: pip install mlflow wandb (or leave it out of "
                     "report_to)"),
])
def test_a_tracker_not_installed_is_one_line_exit_2_and_out_unchanged(report_to, line, tmp_path, capfd,
                                                                      monkeypatch):
    """The library is hidden from `find_spec`, as on a machine without it; mlflow's SQLite store counts as
    missing when sqlalchemy is (MLflow's default store needs it; mlflow-skinny does not bring it)."""
    hidden = {"trackio", "wandb", "sqlalchemy"}
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else find_spec(name, *a))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    code = train_command(["--recipe", "sft_llama13b", "--model", str(_assets()), "--data", str(ALPACA), "--tp", "1",
                          "--report-to", report_to, "--out", str(out)])
    captured = capfd.readouterr()
    assert code == 2 and (captured.out + captured.err).strip() == f"error: {line}", captured
    assert not out.exists()


@pytest.mark.parametrize("saved, trackers", [(True, ["tensorboard"]), (False, []), ("false", [])])
def test_a_config_saved_before_the_trackers_still_loads(saved, trackers):
    """Runs written before `report_to` saved `tensorboard: true|false` in config.yaml and their checkpoints' state;
    resume and `hfmeg export` read it as the `report_to` it meant, not as an unknown field."""
    cfg = train_config({"tensorboard": saved, "train": {"max_steps": 3}})
    assert cfg.report_to == trackers and cfg.train.max_steps == 3
    assert train_config({"report_to": ["mlflow"]}).report_to == ["mlflow"]
