"""QLoRA's settings (`peft.quantize`, `double_quant`, `compute_dtype`, `--peft qlora`) and what loading a 4-bit
base gives a rank: its TP linears hold codes and absmax as buffers, no weight parameter (so the optimizer and the
gradient buffers see the adapters only), each bit-equal to the rank's cut of bitsandbytes' bytes; and a resume
with other quant settings than the checkpoint's is refused; the planner counts the 4-bit base as a rank holds it."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from bounds import rounding_bound, within
from helpers import make_ps
from transformers import LlamaConfig
from tiny_models import save_tiny

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import chunk_rules
from hfmeg.checkpoint.rules_4bit import to_local_4bit
from hfmeg.families import model_config_from_hf
from hfmeg.errors import CheckpointError, HfmegError, UnsupportedConfigError
from hfmeg.parallel.layers import ColumnParallelLinear, RowParallelLinear
from hfmeg.peft.adapters import attach, initialise
from hfmeg.peft.config import PeftConfig
from hfmeg.parallel.launch import spawn
from hfmeg.peft.export import write_info
from hfmeg.plan.layout import PlanLayout
from hfmeg.plan.hardware import ClusterSpec, GpuSpec
from hfmeg.plan.memory import stage_memory
from hfmeg.plan.profile import Profile
from hfmeg.plan.step_time import step_time
from hfmeg.quant.nf4 import dequantize
from hfmeg.quant.qlora import Base4bit, Frozen4bitWeight
from hfmeg.train.parts.adapters import check_resume_settings
from hfmeg.train.validate import load_config

RUN = {"model.path": "some/model", "data.sources": [{"path": "x.json"}]}
SHAPE = dict(hidden_size=128, head_dim=16, intermediate_size=256)  # rows of whole 64-blocks at TP1 and TP2


def test_peft_qlora_is_lora_on_an_nf4_base_with_double_quantization(tmp_path):
    cfg, _ = load_config(None, {**RUN, "peft.method": "qlora", "checkpoint.out": str(tmp_path / "o")}, world_size=1)
    assert (cfg.peft.method, cfg.peft.quantize, cfg.peft.double_quant) == ("lora", "nf4", True)
    assert cfg.peft.base_4bit() == Base4bit("nf4", True)
    plain, _ = load_config(None, {**RUN, "peft.method": "lora", "checkpoint.out": str(tmp_path / "p")}, world_size=1)
    assert plain.peft.base_4bit() is None


@pytest.mark.parametrize("override, field", [
    ({"peft.method": "none", "peft.quantize": "nf4"}, "peft.quantize"),
    ({"peft.method": "lora", "peft.quantize": "int8"}, "peft.quantize"),
    ({"peft.method": "qlora", "peft.compute_dtype": "bf16", "model.dtype": "fp32"}, "peft.compute_dtype")])
def test_bad_qlora_settings_name_the_field(override, field, tmp_path):
    with pytest.raises(HfmegError) as e:
        load_config(None, {**RUN, "checkpoint.out": str(tmp_path / "o"), **override}, world_size=1)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_without_bitsandbytes_qlora_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)
    with pytest.raises(UnsupportedConfigError, match=r"^peft.quantize needs bitsandbytes: pip install "
                                                     r"'bitsandbytes>=0\.50'$"):
        PeftConfig(method="lora", quantize="nf4").check()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    return save_tiny("llama3", tmp_path_factory.mktemp("qlora") / "base", **SHAPE)


def test_a_loaded_4bit_base_holds_codes_as_buffers_and_adapters_alone_train(base):
    ps = make_ps(world=1)
    (chunk,) = load_chunks(HFCheckpoint(base), ps, base_4bit=Base4bit())
    source = HFCheckpoint(base)
    linears = {name: m for name, m in chunk.named_modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)}
    assert len(linears) == 2 * 4  # qkv, out, fc1, fc2 of both layers
    rules = {r.local: r for r in chunk_rules(chunk.cfg, [0, 1], True, True)}
    chunk.to(torch.bfloat16)  # a cast of the model moves the absmax as their bits, unrounded
    for name, layer in linears.items():
        assert isinstance(layer.weight_provider, Frozen4bitWeight) and "weight" not in dict(layer.named_parameters())
        rule = rules[name + ".weight"]
        want = dequantize(to_local_4bit(rule, [source.get(n) for n in rule.hf], chunk.cfg, 1, 0))
        assert torch.equal(layer.matmul_weight(), want), name
        assert layer.weight_provider.codes.dtype == torch.uint8
    chunk.to(torch.float32)
    names = {n for n, _ in chunk.named_parameters()}
    assert not {n + ".weight" for n in linears} & names
    attach(chunk, PeftConfig(method="dora", target_modules=["all-linear"]))
    trainable = [n for n, p in chunk.named_parameters() if p.requires_grad]
    assert trainable and all(".adapter." in n for n in trainable)


@pytest.mark.parametrize("kind, line", [
    ("qwen2_moe", r"^peft.quantize: 4-bit experts are built for routed experts without biases, a plain router and no "
                  r"shared expert \(Mixtral, Qwen3-MoE\); qwen2_moe's are not"),
    ("gpt_oss", r"^peft.quantize: 4-bit experts are built for .*; gpt_oss's are not"),
    ("deepseek_v3", r"^peft.quantize: a 4-bit base is built for standard attention; deepseek_v3 has latent")])
def test_a_4bit_base_is_refused_where_it_is_not_built(kind, line, tmp_path):
    """Experts with biases (gpt-oss), a shared expert (Qwen2-MoE), latent attention (DeepSeek-V3): one line each.
    (Mixtral's and Qwen3-MoE's experts are 4-bit: tests/test_qlora_moe.py.)"""
    pytest.importorskip("bitsandbytes")
    folder = save_tiny(kind, tmp_path / kind)
    with pytest.raises(UnsupportedConfigError, match=line):
        load_chunks(HFCheckpoint(folder), make_ps(world=1), base_4bit=Base4bit())


@pytest.mark.parametrize("saved, now, field", [
    (dict(), dict(quantize="nf4"), "peft.quantize"), (dict(quantize="nf4"), dict(quantize="fp4"), "peft.quantize"),
    (dict(quantize="nf4"), dict(quantize="nf4", double_quant=False), "peft.double_quant"),
    (dict(quantize="nf4", compute_dtype="fp32"), dict(quantize="nf4", compute_dtype="bf16"), "peft.compute_dtype")])
def test_a_resume_with_other_quant_settings_is_refused_naming_the_field(saved, now, field, tmp_path):
    write_info(tmp_path, PeftConfig(method="lora", **saved), {"path": "base", "sha256": "0" * 64})
    with pytest.raises(CheckpointError, match=f"^{field}: "):
        check_resume_settings(tmp_path, PeftConfig(method="lora", **now))
    check_resume_settings(tmp_path, PeftConfig(method="lora", **saved))


QLORA_PEFT = PeftConfig(method="lora", r=4, target_modules=["all-linear"], quantize="nf4")


def _held(folder: str, tp: int, pp: int, ep: int = 1):
    """(pp rank, bytes of this rank's frozen parameters and buffers) of a QLoRA run's chunks."""
    ps = make_ps(tp=tp, pp=pp, ep=ep)
    chunks = load_chunks(HFCheckpoint(folder), ps, base_4bit=QLORA_PEFT.base_4bit())
    for chunk in chunks:
        attach(chunk, QLORA_PEFT)
    return ps.pp_rank, sum(t.numel() * t.element_size() for c in chunks for t in [*c.buffers(), *c.parameters()]
                           if not t.requires_grad)


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2)])
def test_the_planner_counts_a_4bit_base_as_a_rank_holds_it(base, tp, pp):
    """The planner's frozen bytes of a QLoRA run are each loaded rank's exactly: its full-precision parameters
    (norms, embedding, head) and its 4-bit codes and absmax."""
    cfg = load_chunks(HFCheckpoint(base), make_ps())[0].cfg
    for pp_rank, held in spawn(_held, tp * pp, str(base), tp, pp):
        planned = stage_memory(cfg, PlanLayout(tp, pp, 1, 1), pp_rank, 2, 16, 4, peft=QLORA_PEFT)
        assert planned.frozen_weights == held, (pp_rank, planned.frozen_weights, held)
        plain = stage_memory(cfg, PlanLayout(tp, pp, 1, 1), pp_rank, 2, 16, 4, peft=replace(QLORA_PEFT, quantize=None))
        assert planned.frozen_weights < plain.frozen_weights / 2  # fp32 linears at 0.5625 bytes a value


@pytest.mark.parametrize("base_4bit", [Base4bit(), None])
def test_a_4bit_linear_keeps_no_dequantized_weight_for_backward(base, base_4bit):
    """What autograd keeps for backward holds no weight of a 4-bit linear (it is dequantized again there); the
    LoRA run on the unquantized base, which does keep its weights, shows the check sees them."""
    (chunk,) = load_chunks(HFCheckpoint(base), make_ps(world=1), base_4bit=base_4bit)
    attach(chunk, PeftConfig(method="lora", target_modules=["all-linear"]))
    shapes = {tuple(m.matmul_weight().shape) for m in chunk.modules()
              if isinstance(m, ColumnParallelLinear | RowParallelLinear)}
    shapes |= {s[::-1] for s in shapes}  # the matmul may keep W^T
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(tuple(t.shape)) or t, lambda t: t):
        ids = torch.randint(0, 300, (1, 8), generator=torch.Generator().manual_seed(0))
        chunk(ids, labels=ids).sum().backward()
    held = shapes & set(kept)
    assert not held if base_4bit is not None else held


def _step(chunk, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of one forward and every adapter gradient of its backward."""
    for p in chunk.parameters():
        p.grad = None
    loss = chunk(ids, labels=ids).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in chunk.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("method", ["lora", "dora"])
def test_a_4bit_weight_above_the_piece_size_is_dequantized_in_pieces_to_the_same_step(base, method, monkeypatch):
    """With `PIECE_BYTES` under some 4-bit weights' sizes, no dequantized weight is larger than it (the forward cuts
    W's rows, the backward its columns; DoRA's forward reads each whole weight once), and the loss and every adapter
    gradient are the whole weights' step's, within the rounding of two fp32 runs of it (the float64 run the truth)."""
    import hfmeg.quant.qlora as qlora

    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(0))
    runs = {}
    for dtype in (torch.float64, torch.float32):
        (chunk,) = load_chunks(HFCheckpoint(base), make_ps(world=1), dtype=dtype, base_4bit=Base4bit())
        cfg = PeftConfig(method=method, target_modules=["all-linear"])
        attach(chunk, cfg)
        initialise(chunk, cfg, seed=0)
        with torch.no_grad():  # B starts at zero: A's gradients would be too
            for name, p in chunk.named_parameters():
                if name.endswith("lora_B"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        runs[dtype] = _step(chunk, ids)
    sizes = [m.weight_provider.shape.numel() * 4 for m in chunk.modules()
             if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    piece = sorted(sizes)[len(sizes) // 2]  # some weights whole, the larger ones in pieces
    assert piece < max(sizes)
    monkeypatch.setattr(qlora, "PIECE_BYTES", piece)
    dequantized = []
    monkeypatch.setattr(qlora, "dequantize", lambda packed: dequantized.append(packed.shape) or dequantize(packed))
    loss, grads = _step(chunk, ids)
    larger = [rows * cols * 4 for rows, cols in dequantized if rows * cols * 4 > piece]
    assert sorted(larger) == (sorted(s for s in sizes if s > piece) if method == "dora" else [])
    assert len(dequantized) > 2 * len(sizes)  # some weight was cut
    (whole_loss, whole), (loss64, grads64) = runs[torch.float32], runs[torch.float64]
    within((loss - whole_loss).abs().item(), rounding_bound(whole_loss, loss64), "loss")
    assert grads.keys() == whole.keys() and grads
    for name, g in grads.items():
        within((g - whole[name]).abs().max().item(), rounding_bound(whole[name], grads64[name]), name)


def _mapped_after_4bit_load(folder: str) -> tuple[int, int]:
    """In a fresh interpreter (glibc's setting is the process's, and a forked one's heap holds whatever free chunks the
    test process left, which serve a block before any mapping is considered): after a 4-bit load, the bytes glibc
    maps for a 4 MiB block, and for a 2 MiB one after the 4 MiB one is freed (which would raise glibc's own threshold
    above 2 MiB)."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    info = ctypes.CDLL(None).mallinfo2
    info.restype = MallInfo2
    load_chunks(HFCheckpoint(folder), make_ps(world=1), base_4bit=Base4bit())
    mapped = []
    for size in (4 << 20, 2 << 20):
        before = info().hblkhd
        block = torch.empty(size, dtype=torch.uint8)
        mapped.append(info().hblkhd - before)
        del block
    return tuple(mapped)


def test_after_a_4bit_load_glibc_maps_every_block_of_a_mib_or_more(base):
    """A QLoRA rank's dequantization temporaries (1-32 MiB) are mapped on their own and unmapped when freed, not left
    resident in the heap's freed gaps (`checkpoint/load.py`, `_map_large_blocks`), even after a larger mapped block was
    freed (glibc's dynamic threshold would then serve them from the heap)."""
    import ctypes

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("glibc >= 2.33 (mallinfo2) only")
    proc = subprocess.run([sys.executable, "-c", "import sys, test_qlora_settings as t; "
                           "print(*t._mapped_after_4bit_load(sys.argv[1]))", str(base)],
                          cwd=Path(__file__).parent, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    four, two = map(int, proc.stdout.split()[-2:])
    assert four >= 4 << 20 and two >= 2 << 20, (four, two)


@pytest.mark.parametrize("tp, microbatches", [(1, 1), (2, 3)])
def test_the_planner_times_a_4bit_bases_dequantization(tp, microbatches):
    """A QLoRA step is the LoRA step plus, per micro-batch and decoder layer, two dequantizations of its four
    linears as a rank holds them (forward, and again for backward): codes (half a byte a value) and float32 absmax
    (one per 64 values) read, the weight written in the model dtype, at streaming bandwidth; PP 1, so every
    micro-batch's layers add up (the CPU profile adds its fixed costs, it does not overlap them)."""
    hf = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
                     num_key_value_heads=4, vocab_size=300, max_position_embeddings=128)
    cfg = model_config_from_hf(hf)
    lay = PlanLayout(tp, 1, 1, 1)
    prof = Profile("cpu x2", 1e11, ((1e5, 0.5), (1e8, 1.0)), 0.3, 1e10, 1e-3, 5e-4, 5e-5, 1.0,
                   links=((2, 1e9, 1e-4), (8, 2e8, 2e-3)), cores=2)
    cluster = ClusterSpec(GpuSpec("cpu", prof.peak_flops, float("inf"), prof.memory_bytes_per_s, 1e9), tp, tp,
                          reserved_bytes=0)
    lora, qlora = (step_time(cfg, lay, cluster, prof, microbatches, 32, 4, base_4bit=b) for b in (False, True))
    h, ffn, kv = 128, 256 // tp, 4 // tp * 16
    values = h * (h // tp + 2 * kv) + h // tp * h + h * 2 * ffn + ffn * h  # qkv, out, gate+up, down per rank
    per_pass = values / 2 + values / 64 * 4 + values * 4  # fp32 model dtype
    want = microbatches * 3 * 2 * per_pass / prof.memory_bytes_per_s * prof.compute_slowdown(tp)
    # float64 sums of ~1e-2 s totals, differenced: ~1e-13 relative; a pass too many or too few is 50 % off
    assert qlora.step_s - lora.step_s == pytest.approx(want, rel=1e-9)
    assert qlora.compute_s - lora.compute_s == pytest.approx(want, rel=1e-9)


def _held_moe(folder: str, layouts):
    return [(pp, ep, *_held(folder, 1, pp, ep)) for pp, ep in layouts]


def test_the_planner_counts_4bit_experts_as_an_ep_rank_holds_them(tmp_path):
    """The same on a Qwen3-MoE at EP2 (DP4) and EP2 x PP2: an EP rank's 4-bit experts (its share of each stack's
    codes and absmax), the 4-bit attention and dense MLP, and the full-precision router, norms, embedding and head."""
    from test_qlora_moe import SHAPE as MOE_SHAPE
    folder = save_tiny("qwen3_moe", tmp_path / "qwen3_moe", **MOE_SHAPE)
    cfg = load_chunks(HFCheckpoint(folder), make_ps())[0].cfg
    rows = [row for rank in spawn(_held_moe, 4, str(folder), [(1, 2), (2, 2)]) for row in rank]
    for pp, ep, pp_rank, held in rows:
        planned = stage_memory(cfg, PlanLayout(1, pp, 4 // pp, 1, ep=ep), pp_rank, 4, 16, 4, peft=QLORA_PEFT)
        assert planned.frozen_weights == held, (pp, ep, pp_rank, planned.frozen_weights, held)
