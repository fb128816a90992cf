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
