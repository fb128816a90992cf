"""A damaged checkpoint or a full disk is one CheckpointError naming the file (issue 18 #6), not a traceback."""

from __future__ import annotations

import errno

import pytest
from safetensors import SafetensorError

from helpers import make_ps
from hfmeg.errors import CheckpointError
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.optim import state_io
from hfmeg.parallel.launch import spawn
from hfmeg.train.checkpointing import STATE_FILE, read_trainer_state
from optim_harness import CFG, build_rank_chunk
from tiny_models import save_tiny


def test_broken_trainer_state_names_the_file(tmp_path):
    (tmp_path / STATE_FILE).write_text('{"step": 2, "data": ')  # cut short by a crash or a full disk
    with pytest.raises(CheckpointError, match=f"{tmp_path / STATE_FILE}: unreadable .*--resume PATH"):
        read_trainer_state(tmp_path)


def _optimizer_shard_errors(model, folder) -> list[str]:
    ps = make_ps()
    opt = DistributedOptimizer([build_rank_chunk(model, ps)], ps, OptimizerConfig(**CFG))
    path = state_io.save_optimizer_state(opt, folder / "optim")
    path.write_bytes(path.read_bytes()[:1000])  # truncated
    errors = []
    try:
        state_io.load_optimizer_state(opt, folder / "optim")
    except CheckpointError as e:
        errors.append(str(e))

    def full_disk(*args, **kwargs):
        raise SafetensorError(f"Error while serializing: {OSError(errno.ENOSPC, 'No space left on device')}")

    state_io.save_tensors = full_disk  # this forked rank's module only
    try:
        state_io.save_optimizer_state(opt, folder / "optim2")
    except CheckpointError as e:
        errors.append(str(e))
    errors.append(sorted(p.name for p in (folder / "optim2").iterdir()))
    return errors


def test_truncated_optimizer_shard_and_a_full_disk_while_saving_one(tmp_path):
    model = save_tiny("llama3", tmp_path / "model")
    truncated, full, left = spawn(_optimizer_shard_errors, 1, model, tmp_path)[0]
    assert truncated.startswith(f"{tmp_path}/optim/optim_pp000_tp00_dp000.safetensors: not an hfmeg optimizer "
                                "shard, or truncated")
    assert full.startswith(f"{tmp_path}/optim2/optim_pp000_tp00_dp000.safetensors: cannot write the optimizer "
                           "shard (") and "No space left on device" in full
    assert left == []  # no temporary file left behind
