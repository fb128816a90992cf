"""PowerSGD convergence: fine-tune with and without compression, same data and seed (issue 16).

Runs the trainer on `--world` gloo ranks (all data-parallel, fp32) for `--steps` steps:
`plain` (uncompressed, the anchor), then one run per PowerSGD rank in `--ranks`, each
compressed from `--start` (default 10 % of the steps, the config's default). Prints each
run's final loss (mean of the last 10 steps) and its ratio to plain; `--plot PNG` draws
the curves. The last line printed is one JSON object.

By default `--model` is fine-tuned on the SFT `--data`. `--from-scratch` pretrains its
architecture instead, from random weights (transformers' initialisation, `--seed`) on a
text file, reshaped by `--hidden/--layers/--ffn/--heads` (the tokenizer stays):

    .venv/bin/python tools/bench_powersgd_convergence.py --ranks 4 8 16 --plot docs/powersgd_convergence.png
    .venv/bin/python tools/bench_powersgd_convergence.py --from-scratch --hidden 512 --layers 9 --ffn 1376 \
        --heads 8 --lr 1e-3 --seq-len 128 --global-batch-size 8 --data ../shared/assets/data/tinyshakespeare.txt
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
ASSETS = ROOT.parent / "shared" / "assets"


def _train(cfg: TrainConfig) -> None:
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's own printing
        Trainer(cfg).run()


def _config(a, rank: int | None, start: int, out: Path) -> TrainConfig:
    compression = dict(compression="powersgd", powersgd_rank=rank, compression_start_step=start) if rank else {}
    model = ModelArgs(init="random", config_from=a.model, dtype="fp32") if a.from_scratch \
        else ModelArgs(path=a.model, dtype="fp32")
    text = dict(format="text", overlong="split") if a.from_scratch else {}
    return TrainConfig(
        model=model,
        optim=OptimizerConfig(lr=a.lr, weight_decay=0.01, **compression),
        lr=LRScheduleConfig(warmup_steps=5, min_lr=a.lr / 10),
        data=DataConfig(sources=[SourceConfig(a.data)], seq_len=a.seq_len, **text),
        train=LoopArgs(micro_batch_size=1, global_batch_size=a.global_batch_size, max_steps=a.steps, seed=a.seed),
        checkpoint=CheckpointArgs(out=str(out), keep_last=1),
        report_to=[],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ASSETS / "models" / "stories260K"), help="HF folder or Hub id")
    ap.add_argument("--data", default=None, help="default: alpaca_en_demo.json, or the project's text sample with "
                    "--from-scratch")
    ap.add_argument("--from-scratch", action="store_true", help="pretrain --model's architecture from random weights")
    add_shape_args(ap)
    add_loss_run_args(ap, seq_len=256, global_batch_size=16)
    ap.add_argument("--start", type=at_least(0), nargs="+", default=None,
                    help="first compressed step; several: a run per start and rank (default: 10%% of --steps)")
    ap.add_argument("--ranks", type=at_least(1), nargs="+", default=[4], help="PowerSGD ranks")
    a = ap.parse_args(argv)
    a.start = [a.steps // 10] if a.start is None else a.start
    if shape_of(a) and not a.from_scratch:
        ap.error("--hidden/--layers/--ffn/--heads reshape a random model: add --from-scratch")
    if a.data is None:
        a.data = str(ROOT / "data" / "text_sample.txt" if a.from_scratch else ASSETS / "data" / "alpaca_en_demo.json")
    model_name = Path(a.model).name
    runs: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if a.from_scratch:
            a.model = shaped_config(a.model, a, Path(tmp) / "model")
        plans = [(None, 0)] + [(rank, start) for start in a.start for rank in a.ranks]
        for rank, start in plans:
            name = "plain" if rank is None else f"powersgd-r{rank}" + (f"-from{start}" if len(a.start) > 1 else "")
            cfg = _config(a, rank, start, Path(tmp) / name)
            spawn(_train, a.world, cfg, timeout_s=3600)
            runs[name] = loss_curve(cfg.checkpoint.out)
    final = {name: final_loss(losses) for name, losses in runs.items()}
    result = {"model": model_name, "from_scratch": a.from_scratch, "shape": shape_of(a), "world": a.world,
              "steps": a.steps, "start": a.start if len(a.start) > 1 else a.start[0],
              "runs": {name: {"final_loss": f, "vs_plain": f / final["plain"]} for name, f in final.items()}}
    mark = (a.start[0], f"compression from step {a.start[0]}") if len(a.start) == 1 else None
    drawn = a.plot is not None and plot_runs(runs, a.plot, mark=mark)
    result["plot"] = str(a.plot) if drawn else None
    for name, r in result["runs"].items():
        print(f"{name:>20} final loss {r['final_loss']:.4f}  vs plain {r['vs_plain']:.4f}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
