"""A checkpoint holds the model the optimizer trained, even while parameter all-gathers are in flight.

fp32, TP1 x DP2, overlapped optimizer, a checkpoint after every step through the trainer's
`RunCheckpoints.save`. The all-gathers `step()` launches are made to complete late (they start
only when someone waits for them), which is what a slow network does to the real ones: a
save that does not wait writes DP rank 0's parameter buffers while the other rank's shards
still hold the previous step. Every saved model tensor must then equal, bit for bit, the fp32
master shards in the optimizer files saved beside it, and so must the HF export.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from helpers import make_ps
from hfmeg.checkpoint.convert import load_model_config, mp_to_hf
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.optim.state_io import read_meta
from hfmeg.parallel import data_parallel
from hfmeg.parallel.launch import spawn
from hfmeg.train.checkpointing import RunCheckpoints
from optim_harness import CFG, DistributedOptimizer, OptimizerConfig, build_rank_chunk, train
from tiny_models import save_tiny

STEPS = 3


class _LateAllGather:
    """An all-gather handle whose collective starts only in `wait()`: the buffers stay stale until then."""

    def __init__(self, start, args, kwargs):
        self._start, self._args, self._kwargs = start, args, kwargs

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        self._start(*self._args, **self._kwargs).wait()


def _train_and_save(folder: str, out: str) -> None:
    start = data_parallel.all_gather_async  # patched in this forked rank only
    data_parallel.all_gather_async = lambda *a, **k: _LateAllGather(start, a, k)
    ps = make_ps()
    chunk = build_rank_chunk(folder, ps)
    opt = DistributedOptimizer([chunk], ps, OptimizerConfig(mode="overlapped", **CFG))
    checkpoints = RunCheckpoints(Path(out), keep_last=STEPS, resume="none")
    if ps.rank == 0:
        checkpoints.pin_hf_source(Path(folder))
    for step in range(STEPS):
        train(chunk, opt, ps, 1, 1, first_step=step)
        checkpoints.save(step + 1, [chunk], ps, opt, {}, pp_layers=None)


def _master_model(iter_dir: Path, model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model rebuilt from the optimizer's fp32 master shards, checked to cover every element."""
    flat = {n: torch.full((t.numel(),), float("nan")) for n, t in model.items()}
    files = sorted((iter_dir / "optim").glob("optim_*.safetensors"))
    assert len(files) == 2
    for path in files:
        master = load_file(path)["master"]
        for name, lo, hi, off in read_meta(path)["pieces"]:
            flat[name][lo:hi] = master[off : off + hi - lo]
    for name, t in flat.items():
        assert not t.isnan().any(), f"{iter_dir.name}: the optimizer shards do not cover {name}"
    return {n: flat[n].view_as(model[n]) for n in model}


def test_every_checkpoint_and_export_equal_the_optimizer_master(tmp_path):
    folder = save_tiny("llama3", tmp_path / "model")
    spawn(_train_and_save, 2, str(folder), str(tmp_path / "run"))
    root = tmp_path / "run" / "checkpoints"
    cfg = load_model_config(folder)
    for step in range(1, STEPS + 1):
        iter_dir = root / f"iter_{step:07d}"
        model = load_file(iter_dir / "mp_rank_00" / "model.safetensors")
        master = _master_model(iter_dir, model)
        stale = [n for n in model if not torch.equal(model[n], master[n])]
        assert not stale, f"step {step}: {len(stale)} of {len(model)} saved tensors differ from the master: {stale}"

        hf = mp_to_hf(root, tmp_path / f"hf{step}", iteration=step)
        with safe_open(str(hf / "model.safetensors"), "pt") as f:
            exported = {k: f.get_tensor(k) for k in f.keys()}
        want = {}
        for rule in chunk_rules(cfg, range(cfg.num_layers), True, True):
            want.update(to_hf(rule, [master[rule.local]], cfg))
        assert set(exported) == set(want)
        differ = [k for k in want if not torch.equal(exported[k], want[k])]
        assert not differ, f"step {step}: exported tensors differ from the master: {differ}"
