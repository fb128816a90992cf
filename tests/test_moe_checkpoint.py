"""MoE configs and checkpoints: normalisation and refusals, parameter count, HF -> shards -> HF bit-exact
(per-expert tensors as `save_pretrained` writes them, and experts stacked as transformers holds them in
memory), resharding, shape validation and `tools/verify_parity.py` on a tiny Qwen2-MoE at TP2 x PP2."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from bounds import within
from convert_helpers import assert_same_tensors
import forkrun
from helpers import logit_bound, make_ps
from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.mp_reader import MPCheckpoint
from hfmeg.checkpoint.parity import compare, reference_outputs, sharded_outputs
from hfmeg.checkpoint.tensor_source import TensorSource
from hfmeg.checkpoint.reshard import reshard_mp
from hfmeg.config import load_hf_config
from hfmeg.families import model_config_from_hf
from hfmeg.errors import CheckpointError, UnsupportedConfigError
from tiny_models import MOE_KINDS, save_tiny, tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-src")
    return {kind: save_tiny(kind, root / kind) for kind in MOE_KINDS}


def test_moe_config_fields():
    mixtral = model_config_from_hf(tiny_config("mixtral")).moe
    assert (mixtral.num_experts, mixtral.top_k, mixtral.expert_ffn_size, mixtral.norm_topk_prob) == (4, 2, 48, True)
    assert mixtral.sparse_layers == [0, 1] and mixtral.combine_fp32 and mixtral.shared_expert_ffn_size == 0
    qwen2 = model_config_from_hf(tiny_config("qwen2_moe"))
    assert qwen2.moe.sparse_layers == [1] and qwen2.moe.shared_expert_ffn_size == 24 and not qwen2.moe.norm_topk_prob
    assert qwen2.qkv_bias and not qwen2.out_bias and not qwen2.qk_norm
    qwen3 = model_config_from_hf(tiny_config("qwen3_moe"))
    assert qwen3.moe.sparse_layers == [1] and qwen3.moe.norm_topk_prob and qwen3.qk_norm
    assert qwen3.moe.output_router_logits and qwen3.moe.router_aux_loss_coef == 0.1
    # Dense models' normalised config (and so their layout JSON) carries no MoE fields.
    assert not {"moe", "qk_norm"} & set(model_config_from_hf(tiny_config("qwen2")).to_dict())


@pytest.mark.parametrize("field, value", [("router_jitter_noise", 0.1), ("num_experts_per_tok", 5),
                                          ("num_local_experts", 0)])
def test_unsupported_router_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(UnsupportedConfigError, match=f"^config.json field {field}:"):
        model_config_from_hf(tiny_config("mixtral", **{field: value}))


def test_qwen_sliding_window_is_refused():
    with pytest.raises(UnsupportedConfigError, match="^config.json field use_sliding_window:"):
        model_config_from_hf(tiny_config("qwen3_moe", use_sliding_window=True))


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_num_params_counts_every_expert(kind, sources):
    model = AutoModelForCausalLM.from_pretrained(sources[kind])
    weights = sum(p.numel() for n, p in model.named_parameters() if not n.endswith(".bias"))
    assert model_config_from_hf(load_hf_config(sources[kind])).num_params() == weights


@pytest.mark.parametrize("kind", MOE_KINDS)
def test_round_trip_bit_exact(kind, sources, tmp_path):
    for tp, pp in ((1, 1), (2, 2)):
        mp, hf = tmp_path / f"mp{tp}{pp}", tmp_path / f"hf{tp}{pp}"
        hf_to_mp(sources[kind], mp, tp=tp, pp=pp)
        mp_to_hf(mp, hf)
        assert assert_same_tensors(sources[kind], hf) > 0, (tp, pp)


def test_reshard_then_export_bit_exact(sources, tmp_path):
    hf_to_mp(sources["qwen2_moe"], tmp_path / "a", tp=2, pp=2)
    reshard_mp(tmp_path / "a", tmp_path / "b", tp=1, pp=1)
    mp_to_hf(tmp_path / "b", tmp_path / "hf")
    assert_same_tensors(sources["qwen2_moe"], tmp_path / "hf")


def test_expert_shape_mismatch_names_the_tensor(sources, tmp_path):
    folder = save_tiny("qwen3_moe", tmp_path / "bad")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["moe_intermediate_size"] = 8
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"tensor model\.layers\.1\.mlp\.experts\.0\.gate_proj\.weight has shape"):
        hf_to_mp(folder, tmp_path / "out", tp=1, pp=1)
    assert not (tmp_path / "out").exists()


def test_verify_parity_cli_on_moe(tmp_path):
    """TP2 x PP2 (4 forked workers): logits and a greedy continuation against transformers."""
    src = save_tiny("qwen2_moe", tmp_path / "src")
    mp = hf_to_mp(src, tmp_path / "mp", tp=2, pp=2)
    cmd = [sys.executable, str(ROOT / "tools" / "verify_parity.py"), "--mp", str(mp), "--hf", str(src),
           "--max-new-tokens", "8"]
    proc = forkrun.run(cmd, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PARITY OK" in proc.stdout.splitlines()


def _save_stacked(kind: str, folder: Path) -> Path:
    """A checkpoint with transformers' in-memory names: experts stacked (`mlp.experts.gate_up_proj`)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(kind), dtype=torch.float32)
    model.config.save_pretrained(folder)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors",
              metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_stacked_experts_read_and_written_back(kind, tmp_path):
    src = _save_stacked(kind, tmp_path / "src")
    ids = torch.tensor([[1, 17, 42, 7, 99, 5]])
    reference = reference_outputs(src, ids, 3)
    hf_to_mp(src, tmp_path / "mp11", tp=1, pp=1)
    assert MPCheckpoint(tmp_path / "mp11").cfg.moe.fused_experts
    bound = logit_bound(src, ids, reference[0])
    assert compare(sharded_outputs(tmp_path / "mp11", ids, 3), reference, ids.shape[1], bound).ok
    hf_to_mp(src, tmp_path / "mp22", tp=2, pp=2)
    mp_to_hf(tmp_path / "mp22", tmp_path / "hf")
    assert assert_same_tensors(src, tmp_path / "hf") > 0
    assert "model.layers.1.mlp.experts.gate_up_proj" in HFCheckpoint(tmp_path / "hf").keys()


def test_snapshot_of_a_transformers_moe_model_loads(sources):
    """`TensorSource.snapshot` sees transformers' in-memory (stacked) names."""
    model = AutoModelForCausalLM.from_pretrained(sources["qwen3_moe"], dtype=torch.float32)
    chunk = load_chunks(TensorSource.snapshot(model), make_ps())[0]
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        want = model(ids).logits
        diff = (chunk(ids)[..., :300] - want).abs().max().item()
    within(diff, logit_bound(sources["qwen3_moe"], ids, want), "diff", None)
