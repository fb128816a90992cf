"""A base already quantized by bitsandbytes (a `*-bnb-4bit` checkpoint, built here as they are: transformers'
`save_pretrained` of a `BitsAndBytesConfig(load_in_4bit=True, nf4, double quantization)` model) as QLoRA's base:
its codes are read as stored and cut per TP rank, and each rank's dequantized weight is bit-equal to the slice of
bitsandbytes' own dequantization of the stored weight (with no quantization on the way); any other reader gets it
dequantized. Bad input, one line each: a run whose quant settings are not the checkpoint's, a damaged 4-bit tensor,
a format hfmeg cannot use (GPTQ, AWQ, bitsandbytes 8-bit), and `--peft qlora` without bitsandbytes."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("bitsandbytes")
import bitsandbytes.functional as F  # noqa: E402
from helpers import make_ps  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from tool_loader import load_tool  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig  # noqa: E402

import hfmeg.checkpoint.rules_4bit as rules_4bit  # noqa: E402
from hfmeg.checkpoint.hf_reader import HFCheckpoint  # noqa: E402
from hfmeg.checkpoint.load import load_chunks  # noqa: E402
from hfmeg.checkpoint.rules import chunk_rules, to_local  # noqa: E402
from hfmeg.checkpoint.rules_4bit import to_local_4bit  # noqa: E402
from hfmeg.errors import CheckpointError, UnsupportedConfigError  # noqa: E402
from hfmeg.parallel.layers import ColumnParallelLinear, RowParallelLinear  # noqa: E402
from hfmeg.peft.adapters import PEFT_PREFIX  # noqa: E402
from hfmeg.peft.config import PeftConfig  # noqa: E402
from hfmeg.peft.merge import merge_into_hf  # noqa: E402
from hfmeg.quant.nf4 import dequantize  # noqa: E402
from hfmeg.quant.qlora import Base4bit  # noqa: E402
from hfmeg.train import cli  # noqa: E402

# 256 columns everywhere: a TP-4 rank of a row-parallel weight holds whole 64-value blocks
HF = LlamaConfig(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=300, max_position_embeddings=64)
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(the float base, its `*-bnb-4bit` save, transformers' 4-bit model loaded back from that save)."""
    root = tmp_path_factory.mktemp("bnb")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(HF, dtype=torch.float32).save_pretrained(root / "base")
    AutoModelForCausalLM.from_pretrained(root / "base", device_map="cpu", quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32)).save_pretrained(root / "bnb")
    reloaded = AutoModelForCausalLM.from_pretrained(root / "bnb", device_map="cpu")
    return root / "base", root / "bnb", reloaded


def test_the_checkpoint_is_as_published(folders):
    _, bnb, _ = folders
    qc = json.loads((bnb / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["load_in_4bit"], qc["bnb_4bit_quant_type"]) == ("bitsandbytes", True, "nf4")
    stored = load_file(bnb / "model.safetensors")
    assert stored[Q_PROJ].dtype == torch.uint8 and stored[Q_PROJ].shape == (256 * 256 // 2, 1)
    assert {Q_PROJ + s for s in (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map",
                                 ".quant_state.bitsandbytes__nf4")} <= set(stored)


def test_each_rank_holds_its_slice_of_bitsandbytes_dequantization_of_the_stored_weights(folders, monkeypatch):
    _, bnb, reloaded = folders
    source = HFCheckpoint(bnb)
    cfg = source_cfg = load_chunks(HFCheckpoint(folders[0]), make_ps(world=1))[0].cfg
    linears = [r for r in chunk_rules(source_cfg, [0], False, False) if r.kind in ("qkv", "cols", "gate_up")]
    assert len(linears) == 4

    def refuse(*args, **kwargs):
        raise AssertionError("a stored 4-bit weight was quantized again")

    monkeypatch.setattr(rules_4bit, "quantize", refuse)  # read as stored: no dequantize / requantize round
    for rule in linears:
        assert all(source.stored_4bit(n) for n in rule.hf)
        stored = [source.packed_4bit(n) for n in rule.hf]
        held = [reloaded.get_submodule(n.removesuffix(".weight")).weight for n in rule.hf]
        theirs = [F.dequantize_4bit(w.data, w.quant_state) for w in held]  # bitsandbytes on the stored weight
        for tp in (1, 2, 4):
            for rank in range(tp):
                mine = dequantize(to_local_4bit(rule, stored, cfg, tp, rank))
                assert torch.equal(mine, to_local(rule, theirs, cfg, tp, rank)), (rule.local, tp, rank)


def test_a_qlora_load_of_the_stored_base_is_the_load_quantizing_the_float_base(folders):
    """What the run holds from the `*-bnb-4bit` folder is what it holds quantizing the float base itself, the
    codes of every linear and every other parameter."""
    base, bnb, _ = folders
    ps = make_ps(world=1)
    (ours,) = load_chunks(HFCheckpoint(bnb), ps, base_4bit=Base4bit())
    (quantized_here,) = load_chunks(HFCheckpoint(base), ps, base_4bit=Base4bit())
    theirs = dict(quantized_here.named_modules())
    linears = [(n, m) for n, m in ours.named_modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert len(linears) == 4
    for name, layer in linears:
        assert torch.equal(layer.weight_provider.codes, theirs[name].weight_provider.codes), name
        assert torch.equal(layer.matmul_weight(), theirs[name].matmul_weight()), name
    other = dict(quantized_here.named_parameters())
    assert all(torch.equal(p, other[n]) for n, p in ours.named_parameters())


def test_a_full_precision_reader_gets_bitsandbytes_dequantization(folders):
    """Without a 4-bit base (conversion, a full fine-tune) the stored weights are read dequantized, as
    transformers computes them, under the float model's names; the quant state tensors are not tensors of it."""
    base, bnb, reloaded = folders
    source = HFCheckpoint(bnb)
    assert sorted(source.keys()) == sorted(HFCheckpoint(base).keys())
    w = reloaded.get_submodule(Q_PROJ.removesuffix(".weight")).weight
    assert source.shape(Q_PROJ) == (256, 256) and source.dtype(Q_PROJ) == torch.float32
    assert torch.equal(source.get(Q_PROJ), F.dequantize_4bit(w.data, w.quant_state))


@pytest.mark.parametrize("base_4bit, field, stored", [(Base4bit("fp4"), "quantize", "bnb_4bit_quant_type nf4"),
                                                      (Base4bit("nf4", False), "double_quant",
                                                       "bnb_4bit_use_double_quant True")])
def test_a_run_with_other_quant_settings_than_the_checkpoints_is_refused(folders, base_4bit, field, stored):
    with pytest.raises(UnsupportedConfigError) as e:
        load_chunks(HFCheckpoint(folders[1]), make_ps(world=1), base_4bit=base_4bit)
    assert str(e.value).startswith(f"peft.{field}: ") and stored in str(e.value) and "\n" not in str(e.value)


def _damaged(bnb: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    tensors = load_file(bnb / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text((bnb / "config.json").read_text())
    return dst


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.update({Q_PROJ: t[Q_PROJ][:-1]}),
     f"tensor {Q_PROJ} has 32767 values, a [256, 256] nf4 weight in blocks of 64 implies 32768"),
    (lambda t: t.update({Q_PROJ + ".absmax": t[Q_PROJ + ".absmax"][:512]}),
     f"tensor {Q_PROJ}.absmax has 512 values, a [256, 256] nf4 weight in blocks of 64 implies 1024"),
    (lambda t: t.pop(Q_PROJ + ".nested_absmax"),
     f"tensor {Q_PROJ}.nested_absmax is missing (the bitsandbytes 4-bit nested_absmax of {Q_PROJ})")])
def test_a_damaged_4bit_tensor_is_refused_in_one_line_nothing_written(folders, tmp_path, capsys, edit, message):
    bad = _damaged(folders[1], tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=f"^{re.escape(f'{bad}: {message}')}$"):
        load_chunks(HFCheckpoint(bad), make_ps(world=1), base_4bit=Base4bit())
    rc = load_tool("convert_hf_to_mp").main(["--hf", str(bad), "--out", str(tmp_path / "out"), "--tp", "1",
                                                    "--pp", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def _train_refused(capsys, argv: list[str], out: Path) -> str:
    assert cli.main("test", cli.recipe_config("sft_llama13b"), argv + ["--data", "data.json", "--tp", "1", "--preset", "cpu", "--seq-len", "64", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("config, format_name", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "'gptq'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "'awq'"),
    ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bitsandbytes 8-bit")])
def test_a_prequantized_format_hfmeg_cannot_use_is_refused_naming_it(folders, tmp_path, capsys, monkeypatch, config,
                                                                    format_name):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to(folders[0] / "model.safetensors")
    meta = json.loads((folders[0] / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**meta, "quantization_config": config}))
    line = _train_refused(capsys, ["--model", str(model), "--peft", "qlora"], tmp_path / "out")
    assert "quantization_config" in line and format_name in line, line


def test_qlora_without_bitsandbytes_says_what_to_install(folders, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # as if not installed: its import raises ImportError
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    line = _train_refused(capsys, ["--model", str(folders[0]), "--peft", "qlora"], tmp_path / "out")
    assert line == "error: peft.quantize needs bitsandbytes: pip install 'bitsandbytes>=0.50'"


def test_the_merged_export_on_the_stored_base_is_the_one_on_the_float_base(folders, tmp_path):
    """A QLoRA adapter merged into the `*-bnb-4bit` base (its stored weights dequantized, not quantized again) is
    bit for bit the merge into the float base (quantized and dequantized there): the same codes, the same update,
    and no `quantization_config` left."""
    base, bnb, _ = folders
    g = torch.Generator().manual_seed(0)
    module = PEFT_PREFIX + Q_PROJ.removesuffix(".weight")
    tensors = {module + ".lora_A.weight": torch.randn(4, 256, generator=g),
               module + ".lora_B.weight": torch.randn(256, 4, generator=g)}
    cfg = PeftConfig(method="lora", r=4, alpha=8, target_modules=["q_proj"], quantize="nf4")
    ours = load_file(merge_into_hf(bnb, tensors, cfg, tmp_path / "from_bnb") / "model.safetensors")
    theirs = load_file(merge_into_hf(base, tensors, cfg, tmp_path / "from_float") / "model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[n], theirs[n]) for n in theirs)
    assert "quantization_config" not in json.loads((tmp_path / "from_bnb" / "config.json").read_text())
