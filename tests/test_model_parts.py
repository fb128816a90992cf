"""The trainer's model parts (hfmeg/train/parts/): one place picks the kind, the rest of the trainer asks none.

Their behaviour (build, resume checks, checkpoints, export, reshard) is tested through the runs that use them
(test_train.py, test_peft_*.py, test_shared_unlock_train.py, test_reshard_training.py); here: the choice of
kind, the shared-phase optimizer-state rule, and that the files the parts serve carry no branch on the kind.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import hfmeg
from hfmeg.errors import CheckpointError
from hfmeg.models.shared_layers import shared_name
from hfmeg.peft.config import PeftConfig
from hfmeg.train.config import LoopArgs, TrainConfig
from hfmeg.train.parts import Adapters, FullModel, part_class, saved_part

ROOT = Path(hfmeg.__file__).parent
# The callers of the parts: a kind-specific branch here belongs in a part instead.
CALLERS = ("train/trainer.py", "train/export.py", "train/checkpointing.py", "train/reshard_checkpoint.py",
           "commands/export.py")


def test_the_kind_is_picked_from_the_config_and_from_a_checkpoint(tmp_path):
    assert part_class(TrainConfig()) is FullModel
    for method in ("lora", "dora"):
        assert part_class(TrainConfig(peft=PeftConfig(method=method))) is Adapters
    assert saved_part(tmp_path) is FullModel
    (tmp_path / "adapter.json").write_text("{}")
    assert saved_part(tmp_path) is Adapters


def test_a_full_model_reads_shared_optimizer_state_once_unshared_and_never_shares_again():
    part = FullModel(TrainConfig(train=LoopArgs(shared_layers_until=3)), None, torch.float32)
    part.layers_shared = False  # built at or after the unlock
    assert part.optimizer_names({"step": 3, "shared_layers": True}) is shared_name
    assert part.optimizer_names({"step": 4, "shared_layers": False}) is None
    part.layers_shared = True  # built before it
    assert part.optimizer_names({"step": 1, "shared_layers": True}) is None
    with pytest.raises(CheckpointError, match="train.shared_layers_until: the checkpoint at step 2 has unshared"):
        part.optimizer_names({"step": 2, "shared_layers": False})


@pytest.mark.parametrize("caller", CALLERS)
def test_the_callers_do_not_branch_on_the_kind(caller):
    source = (ROOT / caller).read_text()
    found = re.findall(r"peft\.(?:enabled|method)|self\.peft\b|PeftRun|is_adapter_checkpoint|share_layers\(", source)
    assert not found, f"{caller}: {found} (ask the model part, hfmeg/train/parts/)"
