"""Importing the trainer stays light: what a rank (or `hfmeg train`) imports before its first step holds
none of the heavy modules it does not use. Checked in a fresh interpreter, the one place `sys.modules` says
what an import alone pulls in (the pytest process has imported everything by now).

Each of these cost a rank 0.5-1 s of CPU before it was imported lazily (docs/testing.md):
transformers' modeling utilities (and with them accelerate, FSDP and torch._dynamo) came in through
`families.deepseek_v3` for one function, torch.distributed.tensor and sympy through a model config class
the planner's calibration builds, matplotlib is for the loss plot drawn at the end of a run only. The trackers'
libraries (report_to) are imported by rank 0 when it opens them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ENTRY_POINTS = ("hfmeg", "hfmeg.train", "hfmeg.train.trainer", "hfmeg.train.cli", "hfmeg.commands.main")
HEAVY = ("transformers.modeling_utils", "accelerate", "torch._dynamo", "torch.distributed.fsdp",
         "torch.distributed.tensor", "sympy", "matplotlib", "transformers.models.deepseek_v3.modeling_deepseek_v3",
         "tensorboard", "torch.utils.tensorboard", "mlflow", "trackio", "wandb")


def test_importing_the_trainer_pulls_in_no_heavy_module():
    code = (f"import sys, json\nimport {', '.join(ENTRY_POINTS)}\n"
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, check=True)
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "torch" in loaded and "hfmeg.train.trainer" in loaded, "the check must see the imports it makes"
    assert not [m for m in HEAVY if m in loaded], [m for m in HEAVY if m in loaded]


def test_opening_a_checkpoint_pulls_in_no_compiler(tmp_path):
    """Opening a checkpoint (a conversion, every rank of a resume) checks each shard's shape against the layout.
    Computed on meta tensors, the first `torch.cat` imported torch._dynamo, sympy and torch._inductor (1.4 s of CPU);
    the shapes come from the split kinds' arithmetic (`checkpoint.rules.slice_shape`)."""
    from hfmeg.checkpoint.convert import hf_to_mp
    from tiny_models import save_tiny

    mp = tmp_path / "mp"
    hf_to_mp(save_tiny("llama3", tmp_path / "hf"), mp, tp=2, pp=1)  # fused QKV and gate/up: rules that concatenate
    code = ("import sys, json\nfrom hfmeg.checkpoint.mp_reader import MPCheckpoint\n"
            f"MPCheckpoint({str(mp)!r})\nprint(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"}, check=True)
    loaded = set(json.loads(out.stdout.splitlines()[-1]))
    assert "hfmeg.checkpoint.mp_reader" in loaded and "safetensors" in loaded
    assert not [m for m in ("torch._dynamo", "torch._inductor") if m in loaded], "a compiler came with the shapes"
