"""Shared-unlock warm start from scratch: loss curves, and what each phase reduces and holds (issue 16).

Three runs of the trainer on `--world` gloo ranks (all data-parallel), each pretraining the
architecture of `--config-from` from the same random weights (transformers' initialisation,
`--seed`) on the `--data` text for `--steps` steps:

- plain: every layer its own parameters throughout (the anchor);
- shared: layers shared until `--until` (default 10 % of the steps), then unlocked;
- shared+powersgd: the same, with PowerSGD rank `--rank` from the unlock on.

`--hidden`, `--layers`, `--ffn` and `--heads` change the shape of that architecture (the
tokenizer stays), e.g. a 25.8M-parameter LLaMA from stories260K's config:

    .venv/bin/python tools/bench_shared_unlock.py --hidden 512 --layers 8 --ffn 1376 --heads 8 --lr 1e-3 \
        --data ../shared/assets/data/tinyshakespeare.txt

Per run: the final loss (mean of the last 10 steps) and its ratio to plain. Per phase,
read from the live wrapper and optimizer: the elements the data-parallel wrapper sums and
gathers per step (its buckets, padding included: uncompressed, what goes on the wire
scales with it) and the optimizer state bytes per rank. `--plot PNG` draws the three loss
curves. The last line printed is one JSON object.

    .venv/bin/python tools/bench_shared_unlock.py --steps 200 --plot docs/shared_unlock.png
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

from bench_args import add_loss_run_args, add_shape_args, at_least, final_loss, loss_curve, shape_of, shaped_config
from hfmeg.data import DataConfig, SourceConfig
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig
from hfmeg.parallel.launch import spawn
from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, TrainConfig
from hfmeg.train.metrics import plot_runs
from hfmeg.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
STORIES = ROOT.parent / "shared" / "assets" / "models" / "stories260K"
RUNS = ("plain", "shared", "shared+powersgd")


def _volume(opt) -> dict[str, int]:
    return {"dp_elements": sum(b.size for b in opt.buckets), "state_bytes": opt.state_bytes()}


def _train(cfg: TrainConfig) -> tuple[dict, dict]:
    """This rank's volumes at the start and at the end of the run (the trainer's own printing is dropped)."""
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = Trainer(cfg)
        first = _volume(trainer.opt)
        trainer.run()
    return first, _volume(trainer.opt)


def _config(a, run: str, out: Path) -> TrainConfig:
    until = 0 if run == "plain" else a.until
    compression = dict(compression="powersgd", powersgd_rank=a.rank, compression_start_step=until) \
        if run == "shared+powersgd" else {}
    return TrainConfig(
        model=ModelArgs(init="random", config_from=a.model, dtype="fp32"),
        optim=OptimizerConfig(lr=a.lr, weight_decay=0.1, grad_clip=1.0, **compression),
        lr=LRScheduleConfig(warmup_steps=max(1, a.steps // 20), decay="cosine", min_lr=a.lr / 10),
        data=DataConfig(sources=[SourceConfig(a.data)], format="text", overlong="split", seq_len=a.seq_len),
        train=LoopArgs(micro_batch_size=1, global_batch_size=a.global_batch_size, max_steps=a.steps,
                       seed=a.seed, shared_layers_until=until),
        checkpoint=CheckpointArgs(out=str(out / run), resume="none", keep_last=1),
        report_to=[],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-from", default=str(STORIES), help="HF folder or Hub id: architecture and tokenizer")
    add_shape_args(ap)
    ap.add_argument("--data", default=str(ROOT / "data" / "text_sample.txt"), help="text to pretrain on")
    add_loss_run_args(ap, seq_len=128, global_batch_size=8)
    ap.add_argument("--until", type=at_least(1), default=None, help="unlock step (default: 10%% of --steps)")
    ap.add_argument("--rank", type=at_least(1), default=4, help="PowerSGD rank")
    a = ap.parse_args(argv)
    a.until = max(1, a.steps // 10) if a.until is None else a.until
    if a.until >= a.steps:
        ap.error(f"--until {a.until} must be below --steps {a.steps}")
    result = {"config_from": Path(a.config_from).name, "shape": shape_of(a), "world": a.world, "steps": a.steps,
              "until": a.until, "powersgd_rank": a.rank, "runs": {}}
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        a.model = shaped_config(a.config_from, a, Path(tmp) / "model")
        for run in RUNS:
            cfg = _config(a, run, Path(tmp))
            first, last = spawn(_train, a.world, cfg, timeout_s=3600)[0]
            curves[run] = losses = loss_curve(cfg.checkpoint.out)
            result["runs"][run] = {"final_loss": final_loss(losses), "first_phase": first, "last_phase": last}
    plain = result["runs"]["plain"]["final_loss"]
    print(f"{'run':>16} {'final loss':>10} {'vs plain':>8} {'DP elements/step (first -> last)':>34} "
          f"{'state bytes/rank (first -> last)':>34}")
    for run, r in result["runs"].items():
        r["final_vs_plain"] = r["final_loss"] / plain
        f, l_ = r["first_phase"], r["last_phase"]
        print(f"{run:>16} {r['final_loss']:>10.4f} {r['final_vs_plain']:>8.4f} "
              f"{f['dp_elements']:>16,} -> {l_['dp_elements']:>14,} {f['state_bytes']:>16,} -> {l_['state_bytes']:>14,}")
    if a.plot is not None and plot_runs(curves, a.plot, mark=(a.until, f"unlock (step {a.until})")):
        result["plot"] = str(a.plot)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
