"""verify_parity: converted MP checkpoints compute what transformers computes, on every layout.

Each layout runs in a gloo world of its own TP x PP ranks (one spawn each: in a shared world the idle DP
replicas of the smaller layouts cost more waiting in the larger ones' group creation than their forks cost),
TP4 x PP2 and an interleaved (VPP=2) layout among them. Each checks fp32 logits (max-abs, within rounding of transformers' float64 run) and a greedy
continuation against transformers; stories260K's continuation is real text. Rows packed with
several documents (windows shorter than them, soft-capping on) at TP ∈ {1,2} × PP ∈ {1,2}
against transformers run on each document alone (`full_logits` with segment ids).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from bounds import rounding_bound, within
from convert_helpers import LAYOUTS, make_sources
import forkrun
from helpers import logit_bound, make_ps
from hfmeg.checkpoint.convert import hf_to_mp
from hfmeg.checkpoint.parity import compare, prompt_ids, reference_outputs, sharded_outputs
from hfmeg.parallel.launch import free_port, spawn

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = {"stories260K": 16}  # random models: 3


def _layouts():
    return [(tp, pp, 1) for tp, pp in LAYOUTS] + [(2, 2, 2)]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{kind: (hf folder, {(tp, pp, vpp): mp folder})}."""
    root = tmp_path_factory.mktemp("parity")
    out = {}
    for kind, src in make_sources(root / "src").items():
        mps = {}
        for tp, pp, vpp in _layouts():
            if vpp > 1 and kind != "stories260K":
                continue
            mps[(tp, pp, vpp)] = hf_to_mp(src, root / f"{kind}-{tp}{pp}{vpp}", tp=tp, pp=pp, vpp=vpp)
        out[kind] = (src, mps)
    return out


def _run_layout(layout, items):
    """items: [(kind, mp folder, ids, new tokens)] of the world's layout -> {(kind, layout): (logits, ids)} on rank 0."""
    tp, pp, vpp = layout
    ps = make_ps(tp=tp, pp=pp, vpp=vpp)
    results = {(kind, layout): sharded_outputs(mp, ids, n, ps) for kind, mp, ids, n in items}
    return results if dist.get_rank() == 0 else None


def test_parity_on_every_layout(converted):
    inputs = {}
    for kind, (src, mps) in converted.items():
        ids, _ = prompt_ids(next(iter(mps.values())), "Once upon a time", 300)
        inputs[kind] = (ids, NEW_TOKENS.get(kind, 3))
    results = {}
    for layout in _layouts():
        items = [(kind, str(mps[layout]), *inputs[kind]) for kind, (_, mps) in converted.items() if layout in mps]
        results.update(spawn(_run_layout, layout[0] * layout[1], layout, items)[0])
    assert len(results) == sum(len(mps) for _, mps in converted.values())
    for kind, (src, _) in converted.items():
        ids, n = inputs[kind]
        ref = reference_outputs(src, ids, n)
        bound = logit_bound(src, ids, ref[0])
        for (k, layout), ours in results.items():
            if k == kind:
                report = compare(ours, ref, ids.shape[1], tol=bound)
                assert report.ok, (kind, layout, report)


def test_parity_detects_a_wrong_weight(converted, tmp_path):
    src, mps = converted["qwen2"]
    mp = mps[(1, 1, 1)]
    rank_file = mp / "release" / "mp_rank_00" / "model.safetensors"
    tensors = load_file(rank_file)
    tensors["layers.1.mlp.fc2.weight"][0, 0] += 0.05
    save_file(tensors, tmp_path / "model.safetensors")
    good = rank_file.read_bytes()
    try:
        rank_file.write_bytes((tmp_path / "model.safetensors").read_bytes())
        ids, _ = prompt_ids(mp, "", 300)
        ref = reference_outputs(src, ids, 3)
        bound = logit_bound(src, ids, ref[0])
        report = compare(sharded_outputs(mp, ids, 3), ref, ids.shape[1], bound)
    finally:
        rank_file.write_bytes(good)
    assert not report.ok and report.max_abs_logit_diff > bound


def test_verify_parity_cli_stories(converted):
    if "stories260K" not in converted:
        pytest.skip("stories260K assets absent")
    src, mps = converted["stories260K"]
    cmd = [sys.executable, str(ROOT / "tools" / "verify_parity.py"), "--mp", str(mps[(2, 2, 1)]), "--hf", str(src)]
    proc = forkrun.run(cmd, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    diff = float(next(line for line in lines if line.startswith("max_abs_logit_diff=")).split("=")[1])
    ids, _ = prompt_ids(mps[(2, 2, 1)], "Once upon a time", 300)  # the command's default prompt
    within(diff, logit_bound(src, ids, reference_outputs(src, ids, 1)[0]), "diff", None)
    ours = next(line for line in lines if line.startswith("hfmeg greedy")).split(":", 1)[1].strip()
    theirs = next(line for line in lines if line.startswith("transformers greedy")).split(":", 1)[1].strip()
    assert ours == theirs and "little girl named Lily" in ours
    assert "PARITY OK" in lines


def test_verify_parity_cli_under_torchrun(converted):
    """The same check inside a launcher's world (2 processes: TP2), as `torchrun` users run it."""
    src, mps = converted["llama3"]
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun not installed beside this interpreter")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(ROOT / "tools" / "verify_parity.py"), "--mp", str(mps[(2, 1, 1)]), "--hf", str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("max_abs_logit_diff=") == 1 and "PARITY OK" in proc.stdout
    assert "on 2 process(es)" in proc.stdout


PACKED_LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp); the rest of the 4-process world as DP
PACKED_KINDS = ["mistral", "smollm3", "gemma2", "gemma3", "gemma4"]  # windows (4 tokens), soft-capping, RoPE per layer type
DOCS = (7, 12, 5)  # every document longer than the window


def _packed_rows():
    ids = torch.randint(0, 300, (2, sum(DOCS)), generator=torch.Generator().manual_seed(5))
    seg = torch.repeat_interleave(torch.arange(1, len(DOCS) + 1), torch.tensor(DOCS)).expand(2, -1)
    pos = torch.cat([torch.arange(n) for n in DOCS]).expand(2, -1)
    return ids, pos, seg


def _packed_logits(folders: dict[str, str]):
    from hfmeg.checkpoint.hf_reader import HFCheckpoint
    from hfmeg.checkpoint.load import load_chunks
    from hfmeg.models.generate import full_logits

    ids, pos, seg = _packed_rows()
    out = {}
    for tp, pp in PACKED_LAYOUTS:
        ps = make_ps(tp=tp, pp=pp)
        if ps.dp_rank > 0:  # another replica: the same logits again
            continue
        for kind, folder in folders.items():
            logits = full_logits(load_chunks(HFCheckpoint(folder), ps), ps, ids, pos, seg)
            if logits is not None and ps.tp_rank == 0:
                out[(kind, tp, pp)] = logits
    return out


def test_packed_rows_match_transformers_on_tp_and_pp_layouts(tmp_path):
    """Rows packed with three documents, each longer than the sliding window, at TP ∈ {1, 2} × PP ∈ {1, 2}: each
    document's logits against transformers run on that document alone (transformers has no packing), fp32, within
    rounding of transformers' float64 run."""
    from transformers import AutoModelForCausalLM

    from tiny_models import reference_attention, save_tiny

    folders = {kind: str(save_tiny(kind, tmp_path / kind)) for kind in PACKED_KINDS}
    results = {}
    for part in spawn(_packed_logits, 4, folders):
        results.update(part)
    assert sorted(results) == sorted((k, tp, pp) for k in PACKED_KINDS for tp, pp in PACKED_LAYOUTS)
    ids, _, _ = _packed_rows()
    for kind, folder in folders.items():
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                   attn_implementation=reference_attention(folder))
        exact = copy.deepcopy(ref).double()  # the float64 run the bound is derived from
        start = 0
        for n in DOCS:
            with torch.no_grad():
                want = ref(ids[:, start:start + n]).logits
                bound = rounding_bound(want, exact(ids[:, start:start + n]).logits)
            for tp, pp in PACKED_LAYOUTS:
                diff = (results[(kind, tp, pp)][:, start:start + n] - want).abs().max().item()
                within(diff, bound, "packed logit diff", (kind, tp, pp, start))
            start += n
