"""QLoRA: LoRA and DoRA on hfmeg's 4-bit base (`load_chunks(base_4bit=...)`) vs peft on transformers'
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)` with fp32
compute, on a tiny dense LLaMA whose TP-cut rows are whole 64-value blocks: logits, loss and every adapter gradient
at TP in {1, 2} x PP in {1, 2} and TP4, on one 4-process gloo world, and TP4 x PP2 on an 8-process one. Then the
trainer: 20 QLoRA steps at TP2 x PP2 against peft + AdamW on that 4-bit base in one process, its merged export
against peft's merge on the dequantized 4-bit model, its adapter through AutoPeftModelForCausalLM on the 4-bit base,
and a TP2 x PP2 -> TP1 reshard resumed.

The bounds are derived as in tests/test_peft_parity.py (`_references`), with one more fact: bitsandbytes'
dequantized weights are fp32 numbers, so the float64 truth is the same model with those weights in float64.
- peft's float64 run is the transformers model whose quantized linears hold bitsandbytes' dequantization of their
  weights (`_dequantized_reference`), in float64; hfmeg's float64 run is its own 4-bit base dequantized to float64.
  They must agree within ROUNDING_FACTOR times peft's own fp32 rounding (its 4-bit run against that float64 one):
  a rank that held other codes, other absmax or another block's would be off by the 4-bit step (~1e-1 of a weight).
- each layout in fp32 against hfmeg's float64 run, within ROUNDING_FACTOR times hfmeg's unsharded fp32 rounding.
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("bitsandbytes")
import bitsandbytes as bnb  # noqa: E402
from helpers import stories_or_skip  # noqa: E402
from helpers import make_ps, next_token_labels  # noqa: E402
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel, get_peft_model  # noqa: E402
from peft_helpers import hfmeg_chunks, make_base_and_adapter  # noqa: E402
from test_peft_parity import _assert_parity, _check, _peft_outputs, _references  # noqa: E402
from test_peft_train import ALPACA, STEPS, _config, _peft_adamw_losses  # noqa: E402
from test_train import _losses, _run  # noqa: E402
from tiny_models import reference_attention, save_tiny  # noqa: E402
from tool_loader import load_tool  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402
from bounds import relative_bound, rounding_bound, within  # noqa: E402

from hfmeg.models.generate import full_logits  # noqa: E402
from hfmeg.parallel.launch import spawn  # noqa: E402
from hfmeg.quant.qlora import Base4bit  # noqa: E402

LAYOUTS = [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (4, 1, False)]  # tp, pp, sp
# 256 columns per row everywhere (o_proj: 8 heads of 32; down_proj: 256): a TP4 rank of a row-parallel weight holds
# whole 64-value blocks
SHAPE = dict(hidden_size=256, head_dim=32, intermediate_size=256)
QLORA = dict(base_4bit=Base4bit("nf4", double_quant=True))


def _bnb_config() -> BitsAndBytesConfig:
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32)


def _quantized(base: Path):
    return AutoModelForCausalLM.from_pretrained(base, device_map="cpu", quantization_config=_bnb_config(),
                                                attn_implementation=reference_attention(base))


def peft_logits64(dequantized, adapter: Path, ids: torch.Tensor, merged: bool) -> torch.Tensor:
    """peft's logits of `ids` with `adapter` on a float64 copy of the fp32 model `dequantized` (its 4-bit weights'
    dequantization, held exactly), adapters in float64 too, merged into the base first where `merged`: the truth two
    fp32 runs of it (hfmeg's and peft's, or a merged export's and peft's merge's) are bounded against
    (`bounds.rounding_bound`). An MoE's experts run transformers' eager loop (its grouped GEMM has no float64)."""
    base = copy.deepcopy(dequantized)
    base.set_experts_implementation("eager")
    model = PeftModel.from_pretrained(base, adapter).double()
    model = model.merge_and_unload() if merged else model
    with torch.no_grad():
        return model(ids).logits


def _dequantized_reference(base: Path):
    """The fp32 transformers model with each 4-bit linear's weight replaced by bitsandbytes' dequantization."""
    weights = {name: bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
               for name, m in _quantized(base).named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert len(weights) == 2 * 7, "every projection of both layers is 4-bit, the LM head is not"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                 attn_implementation=reference_attention(base))
    with torch.no_grad():
        for name, w in weights.items():
            model.get_submodule(name).weight.copy_(w)
    return model


def _peft_run(ids):
    """`_references`' `reference`: peft on the 4-bit model in fp32, on the dequantized one in float64."""
    def run(base, adapter, dtype):
        model = _quantized(base) if dtype == torch.float32 else _dequantized_reference(base).to(dtype)
        return _peft_outputs(PeftModel.from_pretrained(model, adapter, is_trainable=True), ids, next_token_labels(ids))
    return run


def test_qlora_and_qdora_match_peft_on_a_4bit_base(tmp_path):
    save_tiny("llama3", tmp_path / "llama3_base", **SHAPE)
    cases = [make_base_and_adapter(tmp_path, "llama3", dora=dora) for dora in (False, True)]
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    refs = _references(cases, ids, _peft_run(ids), QLORA)
    # TP1 x PP1 is hfmeg's unsharded fp32 run, which `_references` made in the test process: not again on a rank.
    results = spawn(_check, 4, [(str(b), str(a)) for b, a in cases], ids, LAYOUTS[1:], QLORA)
    _assert_parity(results, refs, cases, LAYOUTS)
    # TP4 x PP2 on 8 ranks, against the same references: each stage's quarter of each projection's codes and absmax
    results = spawn(_check, 8, [(str(b), str(a)) for b, a in cases], ids, [(4, 2, False)], QLORA)
    _assert_parity(results, refs, cases, [(4, 2, False)])


def _trainer_base(root: Path, kind: str = "llama3", shape: dict = SHAPE) -> tuple[Path, Path]:
    """The tiny `kind` (default the LLaMA above) with stories260K's tokenizer (stories260K's own rows are not whole
    64-blocks) and a fresh peft LoRA adapter for it (default init, B = 0); skips where the assets are absent."""
    stories = stories_or_skip()
    if not ALPACA.is_file():
        pytest.skip(f"{ALPACA} is absent")
    base = save_tiny(kind, root / "base", vocab_size=512, **shape)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories / name, base / name)
    torch.manual_seed(0)
    adapter0 = root / "adapter0"
    get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                   LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
                   ).save_pretrained(adapter0)
    return base, adapter0


def _qlora(cfg):
    """A LoRA run's config as `--peft qlora` makes it."""
    return replace(cfg, peft=replace(cfg.peft, quantize="nf4", double_quant=True))


def _trained_vs_peft(cfg, adapter0: Path, reference, dequantized) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer on `cfg` (4 ranks) against peft + torch.optim.AdamW on `reference` (transformers' 4-bit model)
    in one process, on the same batches; its merged export against peft's merge on `dequantized` (the fp32 model
    holding the 4-bit weights' dequantization). (ids, that merge's logits on them)."""
    ref = _peft_adamw_losses(cfg, adapter0, base=reference)
    spawn(_run, 4, cfg)
    out = Path(cfg.checkpoint.out)
    ours = _losses(out)
    assert len(ours) == STEPS and ref[-1] < ref[0]
    # As tests/test_peft_train.py's LoRA runs: the reference trained again in float64 on the dequantized base (what the
    # 4-bit one computes in fp32, exactly; experts by the eager loop) bounds both fp32 runs (bounds.relative_bound).
    # The unquantized base is off by 3e-3 (measured once, to see the test bite).
    base64 = copy.deepcopy(dequantized)
    base64.set_experts_implementation("eager")
    bound = relative_bound(ref, _peft_adamw_losses(cfg, adapter0, base=base64, dtype=torch.float64))
    within(max(abs(x - y) / abs(y) for x, y in zip(ours, ref)), bound, "qlora loss rel", (ours, ref))
    # The merged export is the dequantized 4-bit base plus the update: peft's merge_and_unload on the dequantized
    # model; both are fp32 runs of that merge, so within rounding of each other (float64 truth, `rounding_bound`).
    ids = torch.tensor([[1, 365, 1122, 263, 931, 29892, 727, 471]]) % 512
    want64 = peft_logits64(dequantized, out / "adapter", ids, merged=True)
    with torch.no_grad():
        want = PeftModel.from_pretrained(dequantized, out / "adapter").merge_and_unload()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)(ids).logits
    within((got - want).abs().max(), rounding_bound(want, want64), "qlora merged logits max-abs", None)
    return ids, want


def test_qlora_steps_at_tp2_pp2_match_peft_and_adamw_on_the_4bit_base(tmp_path):
    """The trainer (`--peft qlora`'s settings) at TP2 x PP2 for 20 steps against transformers' 4-bit model with
    peft and torch.optim.AdamW in one process, on the same batches."""
    base, adapter0 = _trainer_base(tmp_path)
    cfg = _qlora(_config(tmp_path / "tp2pp2", base, adapter0, tp=2, pp=2))
    ids, want = _trained_vs_peft(cfg, adapter0, _quantized(base), _dequantized_reference(base))
    out = tmp_path / "tp2pp2"
    with torch.no_grad():
        unquantized = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                                out / "adapter")(ids).logits
    assert (unquantized - want).abs().max() > 1e-3, "the 4-bit base is far (~1e-2) from the unquantized one"
    # The exported adapter loads with AutoPeftModelForCausalLM on the 4-bit base and gives the trained model's logits.
    with torch.no_grad():
        peft_4bit = AutoPeftModelForCausalLM.from_pretrained(out / "adapter", device_map="cpu",
                                                             quantization_config=_bnb_config())(ids).logits
    chunks, _ = hfmeg_chunks(base, out / "adapter", make_ps(), **QLORA)
    # two fp32 runs of the adapter on the dequantized 4-bit base (bitsandbytes' fp32 compute dequantizes exactly)
    bound = rounding_bound(peft_4bit, peft_logits64(_dequantized_reference(base), out / "adapter", ids, merged=False))
    within((full_logits(chunks, make_ps(), ids) - peft_4bit).abs().max(), bound, "qlora export logits max-abs", None)
    card = (out / "adapter" / "README.md").read_text()
    assert "- method: QLoRA (r 4" in card and "stored 4-bit by bitsandbytes (nf4, double quantization on" in card


def resharded_resume(tmp_path: Path, grid_cfg, world: int, base: Path, adapter0: Path, what: str) -> None:
    """Train `grid_cfg` 6 steps on `world` ranks saving at 3, reshard step 3 to TP1 (tools/reshard_mp.py), resume
    it in one process, and compare the last 3 losses with the uninterrupted run's."""
    spawn(_run, world, grid_cfg)
    straight = _losses(tmp_path / "a")
    assert load_tool("reshard_mp").main(["--mp", str(tmp_path / "a" / "checkpoints"), "--iteration", "3", "--out",
                                         str(tmp_path / "tp1"), "--tp", "1", "--pp", "1"]) == 0
    spawn(_run, 1, _qlora(_config(tmp_path / "resumed", base, adapter0, steps=6,
                                  resume=str(tmp_path / "tp1" / "iter_0000003"))))
    resumed = _losses(tmp_path / "resumed")
    assert len(resumed) == 3
    # As tests/test_peft_reshard.py: only the sums' order differs (fp32, ~1e-7 relative per op over 3 steps);
    # a wrong move (a slice, a moment, the step count, another base) shows at 1e-3 or more.
    for x, y in zip(resumed, straight[3:]):
        within(abs(x - y) / abs(y), 1e-5, f"{what} resumed loss rel", (resumed, straight))


def test_a_qlora_checkpoint_resharded_to_tp1_resumes_on_the_uninterrupted_losses(tmp_path):
    """TP2 x PP2 -> TP1 of a QLoRA checkpoint; the resumed run quantizes its base again and continues where the
    uninterrupted one went."""
    base, adapter0 = _trainer_base(tmp_path)
    resharded_resume(tmp_path, _qlora(_config(tmp_path / "a", base, adapter0, tp=2, pp=2, steps=6, save_every=3)), 4,
                     base, adapter0, "qlora")
