"""QLoRA's frozen base, per TP rank (`checkpoint/rules_4bit.py`), against what peft's QLoRA reference holds:
transformers' `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)`
on the CPU. Each rank's dequantized QKV (fused per KV group), output projection (split by columns), gate/up (per
rank) and down projection is bit-equal to the conversion layout of bitsandbytes' dequantization of the HF
weights, at TP 1, 2 and 4."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig  # noqa: E402

from hfmeg.checkpoint.rules import chunk_rules, to_local  # noqa: E402
from hfmeg.checkpoint.rules_4bit import to_local_4bit  # noqa: E402
from hfmeg.errors import UnsupportedConfigError  # noqa: E402
from hfmeg.families import model_config_from_hf  # noqa: E402
from hfmeg.quant import nf4  # noqa: E402
from hfmeg.quant.nf4 import dequantize  # noqa: E402

# 256 columns everywhere: a TP-4 rank of a row-parallel weight holds whole 64-value blocks
HF = LlamaConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=300, max_position_embeddings=64)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qlora") / "base"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(HF, dtype=torch.float32).save_pretrained(folder)
    reference = AutoModelForCausalLM.from_pretrained(folder, device_map="cpu", quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32))
    return load_file(str(folder / "model.safetensors")), reference


def test_each_rank_holds_its_slice_of_the_references_dequantized_weights(base):
    tensors, reference = base
    cfg = model_config_from_hf(HF)
    linears = [r for r in chunk_rules(cfg, [0], False, False) if r.kind in ("qkv", "cols", "gate_up")]
    assert [r.local for r in linears] == ["layers.0.attn.qkv.weight", "layers.0.attn.out.weight",
                                          "layers.0.mlp.fc1.weight", "layers.0.mlp.fc2.weight"]
    for rule in linears:
        hf = [tensors[n] for n in rule.hf]
        held = [reference.get_submodule(n.removesuffix(".weight")).weight for n in rule.hf]
        dequantized = [F.dequantize_4bit(w.data, w.quant_state) for w in held]
        for tp in (1, 2, 4):
            for rank in range(tp):
                mine = dequantize(to_local_4bit(rule, hf, cfg, tp, rank))
                assert torch.equal(mine, to_local(rule, dequantized, cfg, tp, rank)), (rule.local, tp, rank)


def test_a_tp_that_cuts_a_block_is_refused_naming_the_tensor(base):
    tensors, _ = base
    cfg = model_config_from_hf(HF)
    out = next(r for r in chunk_rules(cfg, [0], False, False) if r.kind == "cols")
    with pytest.raises(UnsupportedConfigError, match=r"^layers.0.attn.out.weight: a rank's 32 columns"):
        to_local_4bit(out, [tensors[n] for n in out.hf], cfg, 8, 0)


def test_a_weight_quantized_a_few_rows_at_a_time_has_bitsandbytes_whole_weight_bytes(base, monkeypatch):
    """`nf4.quantize` calls bitsandbytes on a few rows at a time (its CPU quantization's temporaries are ~16 bytes a
    value) and double-quantizes the whole weight's absmax once: 3 rows a call (768 absmax a call, so the nested
    blocks of 256 and the offset span calls), still each rank's slice of the reference's dequantized weights."""
    monkeypatch.setattr(nf4, "QUANTIZE_VALUES", 3 * 256)
    tensors, reference = base
    cfg = model_config_from_hf(HF)
    for rule in [r for r in chunk_rules(cfg, [0], False, False) if r.kind in ("qkv", "cols", "gate_up")]:
        held = [reference.get_submodule(n.removesuffix(".weight")).weight for n in rule.hf]
        dequantized = [F.dequantize_4bit(w.data, w.quant_state) for w in held]
        for tp, rank in ((1, 0), (2, 1)):
            mine = dequantize(to_local_4bit(rule, [tensors[n] for n in rule.hf], cfg, tp, rank))
            assert torch.equal(mine, to_local(rule, dequantized, cfg, tp, rank)), (rule.local, tp, rank)
