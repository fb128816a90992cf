"""Quantized releases converted directly (`hfmeg/quant/`, `hfmeg/checkpoint/quantized.py`): gpt-oss with its MXFP4
experts and DeepSeek-V3 with its block-scaled FP8 weights, each a tiny checkpoint whose config.json is the published
one shrunk (`tests/releases/`), its weights quantized here in the published format; and a Qwen3-FP8-shaped dense
model (the family tests' tiny Qwen3 with Qwen's FP8 quantization_config) for the export.

For each: the converted checkpoint (TP 2) exported back is the model transformers' own dequantizing load makes
(`Mxfp4Config` / `FineGrainedFP8Config(dequantize=True)`), tensor for tensor, bit for bit, in the release's bf16;
its config drops the `quantization_config` and says bfloat16; converting the export again gives the same bytes. The
logits at TP 2 and at EP 2 equal transformers' dequantizing load in fp32 (and the greedy continuations are the same);
a few LoRA steps run on the converted checkpoint. Bad quantized inputs are refused in one line, exit 2.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

from bounds import within
from convert_helpers import assert_same_tensors
from helpers import make_ps, stories_or_skip
from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import saved_dtype
from hfmeg.checkpoint.mp_reader import MPCheckpoint
from hfmeg.checkpoint.parity import reference_outputs, sharded_outputs
from hfmeg.data import DataConfig, SourceConfig
from hfmeg.optim import OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig
from hfmeg.parallel.launch import spawn
from hfmeg.quant.fp8_blocks import dequantize_fp8_blocks
from hfmeg.peft.config import PeftConfig
from hfmeg.quant.mxfp4 import E2M1, dequantize_mxfp4
from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.trainer import Trainer
from tiny_models import ASSETS, tiny_config
from tool_loader import load_tool

RELEASES = Path(__file__).parent / "releases"
ALPACA = ASSETS / "data" / "alpaca_en_demo.json"
IDS = torch.tensor([[5, 17, 42, 7, 99, 3, 8, 250, 11]])
NEW_TOKENS = 4
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
# Qwen3-FP8-shaped: the tiny Qwen3 of the family tests (not a published config: QK-norm, head_dim 16 != 64 / 8
# heads, GQA 8/4, so Q/K/V are fused from three dequantized tensors) with Qwen's FP8 quantization_config, its blocks
# shrunk to 32 x 32 so that every weight holds several
QWEN3_FP8 = {k: v for k, v in tiny_config("qwen3").to_dict().items() if k not in ("dtype", "torch_dtype")} | {
    "torch_dtype": "bfloat16", "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                                       "quant_method": "fp8", "weight_block_size": [32, 32]}}


def release_config(name: str) -> dict:
    return json.loads((RELEASES / f"{name}.json").read_text())["config"]


# --- the published formats, written here (the inverse of hfmeg/quant's dequantization) ---

def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] floats -> ([..., N, K/32, 16] uint8 blocks, [..., N, K/32] uint8 e8m0 scales): each 32-value
    block scaled by the power of two that brings its largest value to at most 6, each value rounded to the
    nearest e2m1 code, two codes a byte (the first in the low nibble)."""
    blocks = w.float().reshape(*w.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -126)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    codes = ((blocks / torch.exp2(exponent).unsqueeze(-1)).unsqueeze(-1) - torch.tensor(E2M1)).abs().argmin(-1)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + 127).to(torch.uint8)


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, C] floats -> (e4m3 [R, C], fp32 scale_inv [ceil(R/r), ceil(C/c)]): each block divided by amax / 448."""
    r, c = block
    R, C = w.shape
    scale_inv = torch.empty(math.ceil(R / r), math.ceil(C / c))
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            scale_inv[i, j] = w[i * r:(i + 1) * r, j * c:(j + 1) * c].float().abs().max().clamp(min=1e-12) / FP8_MAX
    full = scale_inv.repeat_interleave(r, 0)[:R].repeat_interleave(c, 1)[:, :C]
    return (w.float() / full).to(torch.float8_e4m3fn), scale_inv


def _random_model(config: dict, seed: int):
    torch.manual_seed(seed)
    hf = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("quantization_config", "auto_map")})
    model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith(("mlp.gate.weight", "router.weight")):
                p.mul_(10.0)  # clear top-k choices: rounding cannot flip them
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
    return model.to(torch.bfloat16)  # the releases' unquantized tensors are bf16


def save_gpt_oss_mxfp4(folder: Path, config: dict | None = None) -> Path:
    """gpt-oss as openai publishes it: bf16 tensors, the experts' `gate_up_proj` / `down_proj` as MXFP4
    `*_blocks` / `*_scales` of the [E, out, in] matrices (transformers holds [E, in, out])."""
    config = config or release_config("gpt-oss-120b")
    tensors = {}
    for name, t in _random_model(config, 0).state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
        else:
            tensors[name] = t.contiguous()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _fp8_quantized(name: str, t: torch.Tensor) -> bool:
    """DeepSeek-V3's and Qwen3-FP8's FP8 tensors: every linear weight of attention and the MLPs; not the router,
    norms, embedding, LM head."""
    return t.dim() == 2 and ".mlp.gate." not in name and name.endswith(("proj.weight", "proj_with_mqa.weight"))


def save_deepseek_v3_fp8(folder: Path, config: dict | None = None, quantize: bool = True) -> Path:
    """DeepSeek-V3 as published (or another FP8 release's `config`): per-expert tensors (save_pretrained's names),
    the linear weights `F8_E4M3` with a `weight_scale_inv` per block, everything else bf16."""
    config = config or release_config("deepseek-v3")
    plain = folder.parent / (folder.name + "-bf16")
    _random_model(config, 1).save_pretrained(plain)
    block = tuple(config["quantization_config"]["weight_block_size"])
    stored = load_file(plain / "model.safetensors")
    if config.get("num_nextn_predict_layers"):  # an MTP layer, numbered after the model's (layer 1's tensors)
        last, mtp = f"model.layers.{config['num_hidden_layers'] - 1}.", f"model.layers.{config['num_hidden_layers']}."
        stored |= {mtp + n[len(last):]: t.clone() for n, t in stored.items() if n.startswith(last)}
    tensors = {}
    for name, t in stored.items():
        if quantize and _fp8_quantized(name, t):
            tensors[name], tensors[name + "_scale_inv"] = quantize_fp8(t, block)
        else:
            tensors[name] = t
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {"gpt_oss": save_gpt_oss_mxfp4(root / "gpt_oss"), "deepseek_v3": save_deepseek_v3_fp8(root / "deepseek_v3"),
            "qwen3_fp8": save_deepseek_v3_fp8(root / "qwen3_fp8", QWEN3_FP8)}


def _dequantizing_load(src: Path, dtype: torch.dtype):
    method = json.loads((src / "config.json").read_text())["quantization_config"]["quant_method"]
    quant = Mxfp4Config(dequantize=True) if method == "mxfp4" else FineGrainedFP8Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=dtype, quantization_config=quant)


# --- the formats' arithmetic ---

def test_mxfp4_dequantization_is_transformers_to_the_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 5, 4), dtype=torch.uint8, generator=g)  # 2^-27 .. 2^22
    for dtype in (torch.bfloat16, torch.float32):
        ours = dequantize_mxfp4(blocks, scales, dtype)
        assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=dtype))
    # and what the format says, in float64: code c of nibble j, times 2^(s - 127)
    lut = torch.tensor(E2M1, dtype=torch.float64)
    nibbles = torch.stack([blocks & 15, blocks >> 4], -1).flatten(-2).long()
    want = lut[nibbles] * torch.exp2(scales.double() - 127).unsqueeze(-1)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32).double(), want.flatten(-2))


def test_fp8_block_dequantization_with_edge_blocks_is_the_blockwise_product():
    """A 200 x 72 weight in 128 x 64 blocks: the bottom and right blocks are partial (DeepSeek's edge blocks)."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(200, 72, generator=g) * 3).to(torch.float8_e4m3fn)
    scale_inv = torch.rand(2, 2, generator=g) + 0.5
    want = torch.empty(200, 72, dtype=torch.float64)
    for i in range(200):
        for j in range(72):
            want[i, j] = w[i, j].double() * scale_inv[i // 128, j // 64].double()
    got = dequantize_fp8_blocks(w, scale_inv, (128, 64))
    assert got.dtype == torch.float32
    assert torch.equal(got.double(), want.float().double())  # the fp32 product, rounded once


# --- the releases, converted ---

@pytest.mark.parametrize("kind", ["gpt_oss", "deepseek_v3", "qwen3_fp8"])
def test_export_is_transformers_dequantizing_load_bit_for_bit_and_round_trips(releases, kind, tmp_path):
    src = releases[kind]
    assert HFCheckpoint(src).quantized.pairs  # the checkpoint is quantized, and read so
    mp = hf_to_mp(src, tmp_path / "mp", tp=2, pp=1)
    out = mp_to_hf(mp, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert not [n for n in f.keys() if n.endswith(("_blocks", "_scales", "_scale_inv"))]
    ours = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).state_dict()
    theirs = _dequantizing_load(src, torch.bfloat16).state_dict()
    assert ours.keys() == theirs.keys()
    for name, t in theirs.items():  # (transformers keeps DeepSeek's router in fp32 on one load and not the other)
        assert torch.equal(ours[name].float(), t.float()), name
    source, exported = HFCheckpoint(src), HFCheckpoint(out)
    mtp = [n for n in source.keys() if n.startswith(f"model.layers.{config['num_hidden_layers']}.")]
    assert bool(mtp) == (kind == "deepseek_v3")  # DeepSeek's MTP layer: carried, dequantized like the rest
    assert all(torch.equal(exported.get(n), source.get(n).to(torch.bfloat16)) for n in mtp)
    again = mp_to_hf(hf_to_mp(out, tmp_path / "mp2", tp=2, pp=1), tmp_path / "hf2")
    assert assert_same_tensors(out, again) > 0  # the export converts back to itself


def _tp2_ep2(tp2, tp1, ids):
    """(logits, generated ids) of the TP 2 checkpoint at TP 2, and of the TP 1 one with its experts split over EP 2."""
    return {"tp2": sharded_outputs(tp2, ids, NEW_TOKENS), "ep2": sharded_outputs(tp1, ids, NEW_TOKENS, ps=make_ps(ep=2))}


@pytest.mark.parametrize("kind,dtype", [("gpt_oss", "auto"), ("deepseek_v3", "auto"), ("deepseek_v3", "fp32")])
def test_logits_equal_transformers_dequantizing_load_at_tp2_and_ep2(releases, kind, dtype, tmp_path):
    """The reference is what `hfmeg verify` compares with: transformers' dequantizing load in the dtype the
    converted checkpoint holds (bf16 as released, or fp32 on request: the FP8 product unrounded), run in fp32.
    MXFP4 is exact in bf16. Bound: fp32 sums of at most K = hidden + ffn terms per layer, each rounding at most
    K eps of the logits' scale, over the layers."""
    src = releases[kind]
    tp2, tp1 = (hf_to_mp(src, tmp_path / f"tp{tp}", tp=tp, pp=1, dtype=dtype) for tp in (2, 1))
    weights_dtype = saved_dtype(MPCheckpoint(tp2).layout)
    assert weights_dtype == (torch.bfloat16 if dtype == "auto" else torch.float32)
    ref_logits, ref_generated = reference_outputs(src, IDS, NEW_TOKENS, weights_dtype)
    cfg = json.loads((src / "config.json").read_text())
    ffn = cfg.get("moe_intermediate_size", cfg["intermediate_size"])
    bound = cfg["num_hidden_layers"] * (cfg["hidden_size"] + ffn) * torch.finfo(torch.float32).eps \
        * ref_logits.abs().max().item()
    for layout, (logits, generated) in spawn(_tp2_ep2, 2, tp2, tp1, IDS)[0].items():
        within((logits - ref_logits).abs().max().item(), bound, f"{kind} {layout} logits")
        # transformers is run with min_new_tokens (EOS masked until then), hfmeg's greedy continuation is not: they
        # agree up to hfmeg's first EOS (DeepSeek-V3's eos_token_id 1 is one of the tiny vocabulary's likely tokens)
        ours, theirs = generated[0, IDS.shape[1]:].tolist(), ref_generated[0, IDS.shape[1]:].tolist()
        n = ours.index(cfg["eos_token_id"]) if cfg["eos_token_id"] in ours else len(ours)
        assert n >= 1 and ours[:n] == theirs[:n], (layout, ours, theirs)


# --- bad quantized inputs: one line, exit 2, nothing written ---

def _convert(src: Path, out: Path, capsys) -> tuple[int, list[str]]:
    rc = load_tool("convert_hf_to_mp").main(["--hf", str(src), "--out", str(out), "--tp", "1", "--pp", "1"])
    return rc, capsys.readouterr().err.strip().splitlines()


def _edit(src: Path, dst: Path, drop: str | None = None, **config) -> Path:
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != drop}, str(dst / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    for key, value in config.items():
        cfg["quantization_config"][key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("kind,drop,config,message", [
    ("gpt_oss", "model.layers.1.mlp.experts.down_proj_scales", {},
     "tensor model.layers.1.mlp.experts.down_proj_scales is missing (the MXFP4 scales of "
     "model.layers.1.mlp.experts.down_proj_blocks)"),
    ("deepseek_v3", "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv", {},
     "tensor model.layers.1.mlp.experts.3.up_proj.weight_scale_inv is missing (the FP8 block scales of "
     "model.layers.1.mlp.experts.3.up_proj.weight)"),
    ("deepseek_v3", None, {"weight_block_size": [64, 64]},
     "tensor model.layers.0.mlp.down_proj.weight_scale_inv has shape [2, 2], model.layers.0.mlp.down_proj.weight "
     "[256, 256] in blocks of weight_block_size [64, 64] implies [4, 4]"),
    ("deepseek_v3", None, {"weight_block_size": [128]},
     "config.json field quantization_config.weight_block_size: [128]: expected [rows, columns]"),
    ("deepseek_v3", None, {"quant_method": "gptq"},
     "config.json field quantization_config.quant_method: 'gptq' is not supported"),
])
def test_bad_quantized_input_is_refused_in_one_line(releases, tmp_path, capsys, kind, drop, config, message):
    src = _edit(releases[kind], tmp_path / "bad", drop, **config)
    rc, err = _convert(src, tmp_path / "out", capsys)
    assert rc == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_dequantized_checkpoint_that_kept_its_quantization_config_reads_as_stored(tmp_path):
    """bf16 weights under the published FP8 `quantization_config`: nothing to dequantize, every tensor read as
    stored. (transformers 5.24, asked for fp32, keeps such a checkpoint's stacked experts in their stored bf16 --
    its FP8 loader owns their dtype -- and computes them in bf16, hence its logits' 1e-3 difference from an fp32
    run; the weights are the same.)"""
    src = save_deepseek_v3_fp8(tmp_path / "ds", quantize=False)
    source = HFCheckpoint(src)
    assert source.quantized.pairs == {}
    stored = load_file(src / "model.safetensors")
    assert set(source.keys()) == set(stored)
    assert all(torch.equal(source.get(n), t) and source.dtype(n) == t.dtype for n, t in stored.items())


# --- training on a release as published ---

def _train(cfg):
    return str(Trainer(cfg).run().hf_folder)


@pytest.mark.parametrize("kind", ["gpt_oss", "deepseek_v3"])
def test_lora_steps_on_the_release_as_published(releases, kind, tmp_path):
    """3 LoRA steps at TP 2 straight from the quantized folder (the trainer reads it dequantized, as `convert`
    does): the loss is finite, and the merged export is the dequantized model with the update: no
    `quantization_config`, no scales, every tensor but the adapted ones equal to transformers' dequantizing load."""
    stories = stories_or_skip()
    if not ALPACA.is_file():
        pytest.skip(f"{ALPACA} is absent")
    model = tmp_path / "model"
    shutil.copytree(releases[kind], model)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories / name, model / name)
    steps = 3
    cfg = TrainConfig(model=ModelArgs(path=str(model), dtype="fp32"), parallel=ParallelArgs(tp=2),
                      peft=PeftConfig(method="lora", r=4, target_modules=["o_proj"]),
                      optim=OptimizerConfig(lr=1e-3), lr=LRScheduleConfig(warmup_steps=1, total_steps=steps),
                      data=DataConfig(sources=[SourceConfig(str(ALPACA))], seq_len=64),
                      train=LoopArgs(micro_batch_size=1, global_batch_size=2, max_steps=steps, eval_every=0),
                      checkpoint=CheckpointArgs(out=str(tmp_path / "run"), save_every=0, keep_last=1),
                      report_to=[])
    exported = Path(spawn(_train, 2, cfg)[0])
    assert "quantization_config" not in json.loads((exported / "config.json").read_text())
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == steps and all(math.isfinite(x) for x in losses), losses
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        assert not [n for n in f.keys() if n.endswith(("_blocks", "_scales", "_scale_inv"))]
    ours = AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.bfloat16).state_dict()
    theirs = _dequantizing_load(releases[kind], torch.bfloat16).state_dict()
    changed = {n for n, t in theirs.items() if not torch.equal(ours[n].float(), t.float())}
    assert changed and all(n.endswith("o_proj.weight") for n in changed), changed
