"""The cluster launchers in recipes/ run as written: the Slurm script on namespace hosts behind stand-ins for
`srun` and `scontrol`, the Kubernetes manifest against its CRD's schema, accelerate's multi-node config with
its c10d rendezvous on namespace hosts."""

from __future__ import annotations

import json
import os
import subprocess

from hfmeg.train.metrics import read_metrics
from multihost import ROOT, TORCHRUN, train_args
from test_train import ALPACA, _assets

STAND_INS = ROOT / "tests" / "slurm_stand_ins"


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_the_slurm_script_trains_across_hosts(namespace_hosts, tmp_path):
    bed = namespace_hosts(2)
    out = tmp_path / "run"
    env = {**bed.env(0), **bed.stand_in_env(), "PATH": f"{STAND_INS}:{TORCHRUN.parent}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "h[0-1]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242", "GPUS_PER_NODE": "2"}
    hfmeg_args = train_args(_assets(), ALPACA, out, "--tp", "2", steps=3)[3:]  # the script says `-m hfmeg train`
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "slurm" / "train.sbatch"), *hfmeg_args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert len(_losses(out)) == 3 and (out / "hf" / "config.json").is_file()
    state = json.loads((out / "checkpoints" / "iter_0000003" / "trainer_state.json").read_text())
    assert state["dp"] == 2  # TP2 on each of the two hosts: the script started both, and they met
