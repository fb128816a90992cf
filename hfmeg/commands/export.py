"""Export a run's checkpoint, finished or interrupted, as the end of training does.

    hfmeg export OUT                                   # OUT's latest checkpoint -> OUT/hf (+ OUT/adapter)
    hfmeg export OUT --iteration 200 --push-to-hub me/my-model
    hfmeg export OUT/checkpoints/iter_0000200

OUT is a training run's `--out` folder (or one checkpoint inside its `checkpoints/`). The export is the
trainer's own (hfmeg/train/export.py): `OUT/hf`, the model with its tokenizer and model card; a LoRA/DoRA
run's also `OUT/adapter`, the PEFT adapter folder with its card; the metrics in the card are those logged up
to the checkpoint's step; `OUT/export.json` records it. The run's settings come from the checkpoint. It holds
the run's lock while it writes, so it refuses an OUT a live run is using. Bad input is one line and exit 2.
For a lone MP checkpoint with no run around it, use `hfmeg convert to-hf`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..checkpoint.cli import run_cli
from ..checkpoint.mp_layout import resolve_iteration_dir
from ..errors import CheckpointError
from ..optim.state_io import read_meta
from ..train.checkpointing import OPTIM_DIR, STATE_FILE, read_trainer_state
from ..train.config import train_config
from ..train.dataclass_io import ConfigError
from ..train.export import export_run
from ..train.parts import part_class
from ..train.run_lock import RunLock
from ..train.trainer import CONFIG_FILE
from ..train.validate import check_hub_login, check_push_target
from ..flags import Parser

CHECKPOINTS = "checkpoints"  # a run's checkpoint root under its --out (train/checkpointing.py)


def _checkpoint(path: Path, iteration: int | None) -> tuple[Path, Path]:
    """(run folder, iteration folder) of `path`: a run's --out, its checkpoints/ or one checkpoint in it."""
    if not (path / CHECKPOINTS).is_dir() and (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path}: a training run's --out with no checkpoint yet (a run saves one every "
                              "checkpoint.save_every steps, at the end and when stopped by SIGTERM/SIGINT); export it "
                              "once one is saved")
    iter_dir = resolve_iteration_dir(path / CHECKPOINTS if (path / CHECKPOINTS).is_dir() else path, iteration)
    if iter_dir.parent.name != CHECKPOINTS:
        raise CheckpointError(f"{iter_dir}: not a checkpoint of a training run (it is not inside a run's "
                              f"{CHECKPOINTS}/ folder); `hfmeg convert to-hf` exports a lone MP checkpoint")
    return iter_dir.parent.parent, iter_dir


def _skipped_steps(iter_dir: Path) -> int:
    """The run's count of skipped (non-finite) steps, which every optimizer shard of the checkpoint records."""
    shards = sorted((iter_dir / OPTIM_DIR).glob("optim_*.safetensors"))
    if not shards:
        raise CheckpointError(f"{iter_dir / OPTIM_DIR}: no optimizer shard; the checkpoint is incomplete")
    return read_meta(shards[0])["skipped_steps"]


def export(args) -> Path:
    run, iter_dir = _checkpoint(Path(args.run), args.iteration)
    state = read_trainer_state(iter_dir)
    try:
        cfg = train_config(state["config"])
    except ConfigError as e:
        raise ConfigError(f"{iter_dir / STATE_FILE}: field config: {e}") from None
    cfg.hub.push_to_hub, cfg.hub.private = args.push_to_hub, args.private  # the card names the repo pushed to
    if args.push_to_hub:
        check_push_target(args.push_to_hub, part_class(cfg).base_of(cfg))
        print(check_hub_login(args.push_to_hub))
    skipped = _skipped_steps(iter_dir)
    lock = RunLock(run)
    note = lock.acquire()
    if note:
        print(note, file=sys.stderr)
    try:
        print(f"exporting {iter_dir}: step {state['step']} of {cfg.train.max_steps}", flush=True)
        return export_run(run, iter_dir, cfg, step=state["step"], skipped_steps=skipped, dp=state.get("dp"))
    finally:
        lock.release()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = Parser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", metavar="OUT", help="a training run's --out folder, or one checkpoint in it")
    ap.add_argument("--iteration", type=int, default=None,
                    help="the checkpoint of this step (default: the latest, or the one OUT names)")
    ap.add_argument("--push-to-hub", default=None, metavar="REPO",
                    help="upload the export (a LoRA run: its adapter) to this Hub repo")
    ap.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    args = ap.parse_args(argv)
    return run_cli(lambda: export(args))
