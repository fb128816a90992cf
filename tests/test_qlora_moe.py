"""QLoRA on an MoE model under expert parallelism: LoRA (attention, router and the stacked experts) and DoRA
(attention) on hfmeg's 4-bit base vs peft on transformers' `BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)` with fp32 compute, on a tiny Qwen3-MoE (layer 0 dense
through `mlp_only_layers`, layer 1 four experts of 64 x 128) and a tiny Mixtral (both layers four such experts), whose
rows are whole 64-value blocks.

What is 4-bit on each side: transformers replaces the `nn.Linear`s (attention, Qwen3-MoE's layer 0 MLP); its v5 experts are two
stacked parameters and its router a bare parameter, which `load_in_4bit` leaves in fp32 (bitsandbytes issue 1849).
hfmeg stores the experts 4-bit (`checkpoint/rules_4bit.py`), as bitsandbytes' own API for such parameters does:
`bitsandbytes.nn.parametrize.replace_parameter_4bit`, applied here to the reference's stacked experts. peft 0.21.2's
LoRA on parameters gets no gradient through that parametrization (its experts' LoRA stays without `.grad`), so the
reference then holds the parametrization's output as a plain parameter in its place (the same values, bitsandbytes'
dequantization, under peft). The router stays fp32 on both sides.

One 4-process gloo world runs EP2 (DP4), EP2 x TP2 (with and without SP) and EP2 x PP2: each rank's dequantized
expert stacks are bit-equal to its experts of bitsandbytes' dequantization of the whole stacked parameter, and
logits, loss and every adapter gradient (the experts' pieces gathered over EP) are within the bounds derived as in
tests/test_qlora_parity.py (`_references`: float64 truth on the dequantized weights, each side's own fp32 rounding).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("bitsandbytes")
import bitsandbytes as bnb  # noqa: E402
from bitsandbytes.nn.parametrize import replace_parameter_4bit  # noqa: E402
from bounds import rounding_bound, within  # noqa: E402
from helpers import make_ps, next_token_labels  # noqa: E402
from peft import PeftModel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from peft_helpers import hfmeg_chunks, make_base_and_adapter, rel_diff, replica_step  # noqa: E402
from test_peft_parity import _peft_outputs, _references  # noqa: E402
from test_peft_train import _config  # noqa: E402
from test_qlora_parity import (QLORA, _qlora, _quantized, _trained_vs_peft, _trainer_base,  # noqa: E402
                               peft_logits64, resharded_resume)
from tiny_models import reference_attention, save_tiny  # noqa: E402
from torch.nn.utils import parametrize  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from hfmeg.checkpoint.convert import load_model_config  # noqa: E402
from hfmeg.checkpoint.hf_reader import HFCheckpoint  # noqa: E402
from hfmeg.models.generate import full_logits  # noqa: E402
from hfmeg.models.moe import GroupedExperts  # noqa: E402
from hfmeg.parallel.launch import spawn  # noqa: E402
from hfmeg.peft.adapter_files import read_peft_folder  # noqa: E402
from hfmeg.peft.merge import merge_into_hf  # noqa: E402

LAYOUTS = [(1, 1, False, 2), (2, 1, False, 2), (2, 1, True, 2), (1, 2, False, 2)]  # tp, pp, sp, ep
# 128 hidden (4 heads of 32: a TP2 rank's o_proj columns are one 64-block), 128-wide dense MLP, experts 64 wide
SHAPE = dict(hidden_size=128, head_dim=32, intermediate_size=128, moe_intermediate_size=64,
             output_router_logits=False)
STACKS = {"gate_up_proj": "fc1", "down_proj": "fc2"}  # transformers' stacked expert parameter -> hfmeg's stack
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # nn.Linear in v5


def _experts_4bit(model) -> dict[str, torch.Tensor]:
    """Quantize `model`'s stacked experts with bitsandbytes' `replace_parameter_4bit` (nf4, double quantization)
    and leave its dequantization as each plain parameter (module docstring); {hfmeg stack: that dequantization}."""
    out = {}
    for name, module in model.named_modules():
        if not name.endswith("mlp.experts"):
            continue
        for param, stack in STACKS.items():
            replace_parameter_4bit(module, param, compress_statistics=True, quant_type="nf4")
            value = out[f"{name.removeprefix('model.')}.{stack}"] = getattr(module, param).detach().clone()
            parametrize.remove_parametrizations(module, param, leave_parametrized=False)
            setattr(module, param, torch.nn.Parameter(value, requires_grad=False))
    return out


def _bnb_moe(base: Path):
    """transformers' 4-bit model (its `nn.Linear`s) with its experts 4-bit by bitsandbytes too."""
    model = _quantized(base)
    assert _experts_4bit(model), "the model has stacked experts"
    return model


def _dequantized_moe(base: Path):
    """The fp32 transformers model holding bitsandbytes' dequantization of every 4-bit weight of `_bnb_moe`."""
    quantized = _bnb_moe(base)
    weights = {f"{name}.weight": bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
               for name, m in quantized.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    held = [name.rsplit(".", 2)[-2] for name in weights]
    assert set(held) <= set(PROJECTIONS) and held.count("q_proj") == 2, "attention and dense MLPs only"
    weights |= {n: p.detach() for n, p in quantized.named_parameters() if n.rsplit(".", 1)[-1] in STACKS}
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation=reference_attention(base))
    with torch.no_grad():
        for name, w in weights.items():
            model.get_parameter(name).copy_(w)
    return model


def _peft_run(ids):
    """`_references`' `reference`: peft on the 4-bit model in fp32, on the dequantized one in float64."""
    def run(base, adapter, dtype):
        if dtype == torch.float32:
            model = _bnb_moe(base)
        else:  # torch's grouped GEMM, transformers' default for the experts, takes no float64: its plain loop does
            model = _dequantized_moe(base).to(dtype)
            model.set_experts_implementation("eager")
        return _peft_outputs(PeftModel.from_pretrained(model, adapter, is_trainable=True), ids, next_token_labels(ids))
    return run


def _check(cases, ids, stacks_of):
    """Each layout's logits and loss (last stage), full adapter gradients, and whether every expert stack this
    rank holds dequantizes to its experts of `stacks` (bitsandbytes' dequantization of the whole stack)."""
    labels = next_token_labels(ids)
    rows = []
    for base, adapter in cases:
        stacks = stacks_of[base]
        for tp, pp, sp, ep in LAYOUTS:
            ps = make_ps(tp=tp, pp=pp, sp=sp, ep=ep)
            chunks, _ = hfmeg_chunks(base, adapter, ps, **QLORA)
            held = {f"{name}.{stack}": getattr(m, f"{stack}_provider")() for c in chunks
                    for name, m in c.named_modules() if isinstance(m, GroupedExperts) for stack in STACKS.values()}
            experts = chunks[0].experts
            exact = [torch.equal(w, stacks[name][experts.start:experts.stop]) for name, w in held.items()]
            logits = full_logits(chunks, ps, ids)
            loss, grads = replica_step(chunks, ps, ids, labels)
            rows.append(dict(case=adapter, layout=(tp, pp, sp, ep), rank=ps.rank, stacks=len(held), exact=exact,
                             logits=logits, loss=None if logits is None else loss * ps.dp, grads=grads))
    return rows


def test_qlora_and_qdora_on_4bit_experts_match_peft_under_ep(tmp_path):
    save_tiny("qwen3_moe", tmp_path / "qwen3_moe_base", **SHAPE)
    save_tiny("mixtral", tmp_path / "mixtral_base", **{**SHAPE, "intermediate_size": 64})  # its experts' width
    # all-linear: attention, router, gate_up and down (Mixtral's w1 + w3, w2); DoRA on attention, as on experts
    # neither peft nor hfmeg has it
    cases = [make_base_and_adapter(tmp_path, "qwen3_moe"), make_base_and_adapter(tmp_path, "mixtral"),
             make_base_and_adapter(tmp_path, "qwen3_moe", dora=True, targets=["q_proj", "k_proj", "v_proj", "o_proj"])]
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    stacks = {str(b): _experts_4bit(AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32)) for b, _ in cases}
    refs = _references(cases, ids, _peft_run(ids), QLORA)
    results = spawn(_check, 4, [(str(b), str(a)) for b, a in cases], ids, stacks)
    for base, adapter in cases:
        sparse = load_model_config(base).moe.sparse_layers
        (logits64, loss64, grads64), bound, effect, _ = refs[str(adapter)]
        assert effect > 1e-2, "the adapter must change the logits for the test to bite"
        for layout in LAYOUTS:
            rows = [r for rank in results for r in rank if r["case"] == str(adapter) and r["layout"] == layout]
            assert len(rows) == 4 and any(r["logits"] is not None for r in rows)
            for r in rows:
                # both stacks of each MoE layer of the rank's stage (2 layers; PP2: layer r // 2 on rank r), bitwise
                held = [0, 1] if layout[1] == 1 else [r["rank"] // 2]
                assert r["stacks"] == 2 * len(set(held) & set(sparse)) and all(r["exact"]), r["rank"]
                row = dict(case=r["case"], layout=layout, rank=r["rank"])
                if r["logits"] is not None:
                    within((r["logits"].double() - logits64).abs().max().item(), bound["logit_diff"], "logit_diff", row)
                    within(abs(r["loss"] - loss64), bound["loss_diff"], "loss_diff", row)
                within(max(rel_diff(g.double(), grads64[k]) for k, g in r["grads"].items()), bound["grad_rel"],
                       "grad_rel", row)
            assert sorted({g for r in rows for g in r["grads"]}) == sorted(grads64), layout


@pytest.mark.parametrize("kind, stacked", [("qwen3_moe", False), ("mixtral", False), ("qwen3_moe", True)])
def test_a_merged_moe_qlora_adapter_is_peft_merged_on_the_dequantized_4bit_base(kind, stacked, tmp_path):
    """The merged export of a QLoRA adapter on an MoE base: the 4-bit base dequantized (each expert stack quantized
    whole) plus the update, as peft's `merge_and_unload` gives on `_dequantized_moe`; the base's experts one tensor
    each on disk (`experts.{e}.gate_proj`, Mixtral's `w1` ...), or `stacked` as transformers holds them."""
    save_tiny(kind, tmp_path / f"{kind}_base", **{**SHAPE, "intermediate_size": 128 if kind == "qwen3_moe" else 64})
    base, adapter = make_base_and_adapter(tmp_path, kind)
    if stacked:  # the same weights under transformers' in-memory names: each layer's experts two stacked tensors
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        base = tmp_path / "stacked"
        model.config.save_pretrained(base)
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, base / "model.safetensors",
                  metadata={"format": "pt"})
    cfg, tensors = read_peft_folder(adapter)
    merged = merge_into_hf(base, tensors, replace(cfg, quantize="nf4", double_quant=True), tmp_path / "merged")
    assert ("model.layers.1.mlp.experts.gate_up_proj" in HFCheckpoint(merged).keys()) == stacked
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(1))
    dequantized = _dequantized_moe(base)
    want64 = peft_logits64(dequantized, adapter, ids, merged=True)
    with torch.no_grad():
        want = PeftModel.from_pretrained(dequantized, adapter).merge_and_unload()(ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)(ids).logits
        unquantized = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                                                adapter).merge_and_unload()(ids).logits
    # both fp32 runs of peft's merge on the dequantized base: within rounding of each other (float64 truth)
    within((got - want).abs().max(), rounding_bound(want, want64), "qlora moe merged logits max-abs", kind)
    assert (unquantized - want).abs().max() > 1e-3, "the 4-bit base is far from the unquantized one"


def test_qlora_steps_on_4bit_experts_at_ep2_match_peft_and_adamw(tmp_path):
    """The trainer (`--peft qlora`'s settings) on the tiny Qwen3-MoE at EP2 (DP4) for 20 steps against peft +
    torch.optim.AdamW on `_bnb_moe` in one process, on the same batches; its merged export against peft's merge on
    the dequantized 4-bit model (`_trained_vs_peft`)."""
    base, adapter0 = _trainer_base(tmp_path, "qwen3_moe", SHAPE)
    cfg = _qlora(_config(tmp_path / "ep2", base, adapter0))
    _trained_vs_peft(replace(cfg, parallel=replace(cfg.parallel, ep=2)), adapter0, _bnb_moe(base),
                     _dequantized_moe(base))


def test_a_moe_qlora_checkpoint_resharded_to_tp1_resumes_at_ep1_on_the_uninterrupted_losses(tmp_path):
    """EP2 x TP2 -> TP1 (tools/reshard_mp.py) of a QLoRA checkpoint of the tiny Qwen3-MoE, resumed in one process
    (EP1): the experts' adapters and their optimizer state travel by global expert index, the resumed run quantizes
    its base again (each expert stack whole, as every EP2 rank did) and continues where the uninterrupted one went."""
    base, adapter0 = _trainer_base(tmp_path, "qwen3_moe", SHAPE)
    cfg = _qlora(_config(tmp_path / "a", base, adapter0, tp=2, steps=6, save_every=3))
    resharded_resume(tmp_path, replace(cfg, parallel=replace(cfg.parallel, ep=2)), 4, base, adapter0, "moe qlora")
