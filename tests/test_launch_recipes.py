"""The cluster launchers in recipes/ run as written: the Slurm script on namespace hosts behind stand-ins for
`srun` and `scontrol`, the Kubernetes manifest against its CRD's schema, accelerate's multi-node config with
its c10d rendezvous on namespace hosts.

The launchers' runs put one CPU rank on each of the two hosts (TP1 x DP2): what they check is that the file starts
one launcher per host and that the hosts meet at the head's rendezvous (DP2 is the two hosts' ranks in one job);
the ranks per host are a number the file passes through to torchrun, and every further rank is a fresh
interpreter (4-5 s of CPU importing torch and transformers).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import yaml

from hfmeg.train.metrics import read_metrics
import forkrun
from multihost import ROOT, TORCHRUN, recipe_flags, wait_all
from test_train import ALPACA, _assets

STAND_INS = ROOT / "tests" / "slurm_stand_ins"
MANIFEST = ROOT / "recipes" / "k8s" / "pytorchjob.yaml"
SCHEMA = ROOT / "tests" / "schemas" / "pytorchjob.schema.json"


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_the_slurm_script_trains_across_hosts(namespace_hosts, tmp_path):
    bed = namespace_hosts(2)
    out = tmp_path / "run"
    env = {**bed.env(0), **bed.stand_in_env(), "PATH": f"{STAND_INS}:{TORCHRUN.parent}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "h[0-1]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242", "GPUS_PER_NODE": "1"}
    hfmeg_args = ["--recipe", "sft_llama13b", *recipe_flags(_assets(), ALPACA, out, "--tp", "1", steps=3)]
    proc = subprocess.run(["bash", str(ROOT / "recipes" / "slurm" / "train.sbatch"), *hfmeg_args], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert len(_losses(out)) == 3 and (out / "hf" / "config.json").is_file()
    state = json.loads((out / "checkpoints" / "iter_0000003" / "trainer_state.json").read_text())
    assert state["dp"] == 2  # a rank on each of the two hosts: the script started both, and they met


def test_the_accelerate_multi_node_config_meets_on_c10d(namespace_hosts, tmp_path):
    """The file as shipped, with the node count and rank, the head's address and (here) 1 CPU rank per host."""
    bed = namespace_hosts(2)
    out = tmp_path / "run"
    accelerate = TORCHRUN.with_name("accelerate")
    script_args = recipe_flags(_assets(), ALPACA, out, "--tp", "1", steps=3)
    procs = [bed.popen(i, [str(accelerate), "launch", "--config_file", str(ROOT / "recipes/accelerate/multi_node.yaml"),
                           "--num_processes", "2", "--machine_rank", str(i), "--main_process_ip", bed.hostname(0),
                           str(ROOT / "recipes" / "sft_llama13b.py"), *script_args], tmp_path / f"host{i}.log")
             for i in range(2)]
    codes = wait_all(procs, 180)
    assert codes == [0, 0], "\n".join((tmp_path / f"host{i}.log").read_text(errors="replace")[-3000:] for i in range(2))
    assert len(_losses(out)) == 3
    state = json.loads((out / "checkpoints" / "iter_0000003" / "trainer_state.json").read_text())
    assert state["dp"] == 2  # a rank on each host: both machine ranks met on c10d


def test_the_kubernetes_manifest_is_a_pytorchjob_that_hfmeg_accepts():
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is not installed (pip install -e '.[dev]')")
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert [e.message for e in validator.iter_errors(manifest)] == []
    # The schema bites: a backend the operator does not know, a restart policy Kubernetes does not, a misspelt field.
    for path, value in ((("spec", "elasticPolicy", "rdzvBackend"), "static"),
                        (("spec", "pytorchReplicaSpecs", "Worker", "restartPolicy"), "Sometimes"),
                        (("spec", "elasticPolicy", "maxRestart"), 3)):
        bad = copy.deepcopy(manifest)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert list(validator.iter_errors(bad)), path

    # What the operator starts: torchrun (its rendezvous from PET_*) running hfmeg with the manifest's arguments,
    # on replicas x nprocPerNode ranks, which the config must fit (hfmeg checks it at this world size).
    spec = manifest["spec"]
    worker = spec["pytorchReplicaSpecs"]["Worker"]
    assert spec["elasticPolicy"]["minReplicas"] == spec["elasticPolicy"]["maxReplicas"] == worker["replicas"]
    container = next(c for c in worker["template"]["spec"]["containers"] if c["name"] == "pytorch")
    assert container["command"] == ["torchrun", "-m", "hfmeg", "train"]
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]  # a pod can rejoin
    nproc = int(spec["nprocPerNode"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == nproc
    world = worker["replicas"] * nproc
    proc = forkrun.run([sys.executable, "-m", "hfmeg", "train", *container["args"], "--print-config"],
                       env={**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": str(world)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tp = yaml.safe_load(proc.stdout)["parallel"]["tp"]
    assert nproc % tp == 0, f"TP {tp} spans pods of {nproc} GPUs"
