"""Gemma 4 as released: tiny checkpoints built from the published 31B and 26B-A4B configs (`tests/releases/`, sizes
shrunk, every other field as published, each file naming its source) against transformers and peft.

Both: full-attention layers with their own head size and KV heads (`global_head_dim`, `num_global_key_value_heads`),
keys reused as values there (`attention_k_eq_v`), `proportional` RoPE on them, `use_bidirectional_attention: vision`
(causal on text), each layer's `layer_scalar` (set off 1 here); the 26B-A4B adds the MoE block beside the dense MLP.
- one 4-rank world per release: at TP2 x PP2 (and the 26B-A4B at PP2 x EP2 too) logits equal to transformers' and
  greedy generation equal; LoRA logits and loss equal to peft's, and its adapter gradients as close to peft's float64
  ones as peft's own fp32 ones are, each within the bound derived from transformers' and peft's float64 runs
  (`float64_reference`); the peft adapter imported onto shards and exported back bit for bit; HF -> TP2 x PP2
  shards -> HF bit-exact;
- CP2 x TP2 (SP) and CP2 x PP2 against one process (tests/test_cp_parity.py's check), both releases in one world;
- 5 trainer steps of the 26B-A4B at TP2, exported and loaded by transformers, `layer_scalar` untouched;
- the 26B-A4B as its published multimodal wrapper: round trip with the vision tower, the wrapper class's logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from bounds import parity_bounds, rounding_bound, within
from convert_helpers import assert_same_tensors
from helpers import logit_bound, make_ps, next_token_labels
from peft_helpers import full_adapter_grads, hfmeg_chunks, peft_adapter_grads, peft_reference, rel_diff
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Gemma4TextConfig

from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data.microbatch import MicroBatch
from hfmeg.families import model_config_from_hf
from hfmeg.families.llama import PROJECTIONS
from hfmeg.models.generate import full_logits, greedy_generate
from hfmeg.plan.flops import layer_matmul_params
from hfmeg.parallel.comm import sync_sequence_parallel_grads
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.peft.adapter_files import WEIGHTS_FILE, assemble, write_adapter_shard, write_peft_folder

RELEASES = Path(__file__).parent / "releases"


def release_config(name: str) -> Gemma4TextConfig:
    return Gemma4TextConfig.from_dict(json.loads((RELEASES / f"{name}.json").read_text())["config"])


def save_release(name: str, folder: Path, seed: int = 0) -> Path:
    """A random fp32 checkpoint of the shrunk release `name`; norms, router scales and each layer's `layer_scalar`
    moved off their init (ones) so that their layout and use show."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(release_config(name), dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith(("router.scale", "per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.1)
            if n.endswith("router.proj.weight"):  # clear top-k choices: fp32 rounding cannot flip them
                p.mul_(10.0)
        for n, b in model.named_buffers():
            if n.endswith("layer_scalar"):  # a value of its own per layer, as a trained checkpoint holds
                b.uniform_(0.75, 1.25)
    model.save_pretrained(folder)
    return folder


def make_adapter(base: Path, out: Path, targets, seed: int = 1) -> Path:
    """peft's LoRA on `targets`, A and B both random so every gradient is non-zero."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(model, cfg).save_pretrained(out)
    return out


def test_release_configs_are_read():
    cfg = model_config_from_hf(release_config("gemma-4-31B"))
    full = [i for i in range(cfg.num_layers) if cfg.window(i) is None]
    assert full == [5]
    assert (cfg.num_kv_heads, cfg.head_dim) == (4, 8)
    a = cfg.attention_shape(5)
    assert (a.num_kv_heads, a.head_dim, a.values_from_keys) == (2, 16, True)
    assert cfg.rotary_dim_of(5) == 16 and cfg.rotary_dim_of(0) == 8
    # The planner's and the MFU's count: q (8 heads x 16) and k (2 x 16), no v, o (8 x 16 back), the GeGLU MLP
    h, f = 32, 64
    assert layer_matmul_params(cfg, 5) == h * (8 * 16 + 2 * 16) + 8 * 16 * h + 3 * h * f
    assert layer_matmul_params(cfg, 0) == h * (8 * 8 + 2 * 4 * 8) + 8 * 8 * h + 3 * h * f
    for name in RELEASE_CASES:  # every parameter and each layer's scalar, the MoE block's beside the dense MLP
        model = AutoModelForCausalLM.from_config(release_config(name))
        held = sum(p.numel() for p in model.parameters()) + sum(b.numel() for n, b in model.named_buffers()
                                                                  if n.endswith("layer_scalar"))
        assert model_config_from_hf(release_config(name)).num_params() == held, name


def transformers_reference(base: Path, adapter: Path, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """What `_parity` compares each layout with, computed once in the test process (not on every rank): transformers'
    fp32 logits of `ids` and greedy continuation of `ids[:1, :8]`, peft's LoRA logits and mean loss."""
    ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    labels = next_token_labels(ids)
    model = peft_reference(base, adapter, trainable=False)
    with torch.no_grad():
        out = dict(logits=ref(ids).logits, gen=ref.generate(ids[:1, :8], max_new_tokens=6, do_sample=False),
                   lora_logits=model(ids).logits)
    loss = torch.nn.functional.cross_entropy(out["lora_logits"].flatten(0, 1), labels.flatten(), reduction="sum")
    return dict(out, lora_loss=loss.item() / int((labels != -100).sum()))


def _parity(base: str, adapter: str, ids: torch.Tensor, mp_shards: str, layouts, exact: dict[str, torch.Tensor],
            ref: dict[str, torch.Tensor], pp_layers: list[int] | None = None):
    """Per layout (tp, pp, ep) on this rank, its pipeline split `pp_layers` (None: even): logits and greedy generation
    against transformers, then LoRA logits, loss against peft (`ref`: `transformers_reference`) and adapter gradients
    against peft's float64 ones (`exact`); at the first layout the imported adapter exported back."""
    labels = next_token_labels(ids)
    tokens = int((labels != -100).sum())
    rows = []
    for n, (tp, pp, ep) in enumerate(layouts):
        ps = make_ps(tp=tp, pp=pp, ep=ep)
        chunks = load_chunks(HFCheckpoint(base), ps, pp_layers=pp_layers)
        logits = full_logits(chunks, ps, ids)
        row = {"layout": (tp, pp, ep), "gen_equal": torch.equal(greedy_generate(chunks, ps, ids[:1, :8], 6), ref["gen"])}
        chunks, cfg = hfmeg_chunks(base, adapter, ps, pp_layers=pp_layers)
        lora_logits = full_logits(chunks, ps, ids)
        mb = [MicroBatch(input_ids=ids, labels=labels)]
        loss = forward_backward(chunks, ps, mb, schedule="1f1b", num_tokens=tokens)
        sync_sequence_parallel_grads(chunks, ps)  # the adapters' partial gradients summed over TP
        grads = full_adapter_grads(chunks, ps)
        row["grad_names"] = sorted(grads)
        row["grad_err"], row["grad_worst"] = max((rel_diff(g.double(), exact[k]), k) for k, g in grads.items())
        if logits is not None:
            row["logit_diff"] = (logits - ref["logits"]).abs().max().item()
            row["lora_logit_diff"] = (lora_logits - ref["lora_logits"]).abs().max().item()
            row["loss_diff"] = abs(loss - ref["lora_loss"])
        if n == 0:  # the peft-made adapter imported onto shards, exported back
            shards = Path(mp_shards)
            write_adapter_shard(chunks, ps, shards / f"mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}")
            dist.barrier()
            if ps.rank == 0:
                back = write_peft_folder(Path(f"{shards}_back"), assemble(shards), cfg, base)
                source, again = (load_file(str(Path(f) / WEIGHTS_FILE)) for f in (adapter, back))
                row["adapter_exact"] = source.keys() == again.keys() and all(torch.equal(source[k], again[k])
                                                                             for k in source)
        rows.append(row)
    return rows


def float64_reference(base: Path, adapter: Path, ids: torch.Tensor,
                      fp32_paths: tuple[str, ...] = ("eager",)) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """peft's adapter gradients in float64 on this batch, and the bounds on `_parity`'s rows (`check_parity_rows`)
    derived from transformers' and peft's runs in fp32 over the attention paths `fp32_paths` (each sums the same
    terms in another order) against the same runs in float64 (tests/bounds.py): the logits, LoRA logits and loss,
    two fp32 runs compared, and the adapter gradients, one fp32 run against the float64 ones.

    Six layers of attention at scale 1 over q/k-normed heads (Gemma 4's), each output scaled, are ill-conditioned
    enough that fp32 loses a few 1e-4 relative on the first layers' gradients: hfmeg's fp32 gradients are held to
    the float64 ones as tightly as peft's fp32 gradients are (ROUNDING_FACTOR times their worst error)."""
    labels = next_token_labels(ids)
    runs = {}
    for dtype, attention in [(torch.float64, "eager")] + [(torch.float32, path) for path in fp32_paths]:
        # transformers' grouped-GEMM experts have no float64 kernel; its eager loop is the same arithmetic
        plain = AutoModelForCausalLM.from_pretrained(base, dtype=dtype, attn_implementation=attention,
                                                     experts_implementation="eager")
        with torch.no_grad():
            plain_logits = plain(ids).logits
        model = PeftModel.from_pretrained(plain, adapter, is_trainable=True).to(dtype)
        logits = model(ids).logits
        loss = torch.nn.functional.cross_entropy(logits.double().flatten(0, 1), labels.flatten(), reduction="sum")
        (loss / (labels != -100).sum()).backward()
        runs[dtype, attention] = plain_logits, (logits.detach(), loss.item() / int((labels != -100).sum()),
                                                peft_adapter_grads(model))
    plain64, lora64 = runs[torch.float64, "eager"]
    bounds = {}
    for path in fp32_paths:
        plain32, lora32 = runs[torch.float32, path]
        two_runs, one_run = parity_bounds(lora32, lora64), parity_bounds(lora32, lora64, runs=1)
        for what, bound in dict(logit_diff=rounding_bound(plain32, plain64), lora_logit_diff=two_runs["logit_diff"],
                                loss_diff=two_runs["loss_diff"], grad_err=one_run["grad_rel"]).items():
            bounds[what] = max(bounds.get(what, 0.0), bound)
    return lora64[2], bounds


# The 31B: LoRA on all-linear (peft finds no v_proj on the full layers, where the keys are the values). The 26B-A4B:
# attention and the dense MLP (peft's all-linear would add the router's `proj`, which hfmeg does not adapt), at
# TP2 x PP2 and at PP2 x EP2 (its experts spread over two DP ranks that see the same batch here).
RELEASE_CASES = {"gemma-4-31B": ("all-linear", [(2, 2, 1)]),
                 "gemma-4-26B-A4B": (list(PROJECTIONS), [(2, 2, 1), (1, 2, 2)])}


@pytest.mark.parametrize("release", RELEASE_CASES)
def test_release_parity_lora_and_round_trip(release, tmp_path):
    targets, layouts = RELEASE_CASES[release]
    base = save_release(release, tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", targets)
    peft_names = set(load_file(str(adapter / WEIGHTS_FILE)))
    assert not any(".5.self_attn.v_proj" in k for k in peft_names) and any(".4.self_attn.v_proj" in k for k in peft_names)
    hf_to_mp(base, tmp_path / "mp", tp=2, pp=2)
    mp_to_hf(tmp_path / "mp", tmp_path / "back")
    assert assert_same_tensors(base, tmp_path / "back") > 0
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    exact, bounds = float64_reference(base, adapter, ids)
    rows = [r for rank in spawn(_parity, 4, str(base), str(adapter), ids, str(tmp_path / "lora_shards"), layouts,
                                exact, transformers_reference(base, adapter, ids)) for r in rank]
    check_parity_rows(rows, layouts, peft_names, bounds)


def check_parity_rows(rows: list[dict], layouts, peft_names: set[str], bounds: dict[str, float]) -> None:
    """`_parity`'s rows: greedy text and the adapter round trip exact; every adapter tensor on some stage; LoRA
    gradients, and every last-stage rank's logits, LoRA logits and loss, within the `bounds` `float64_reference`
    derived."""
    assert all(r["gen_equal"] for r in rows)
    assert [r["adapter_exact"] for r in rows if "adapter_exact" in r] == [True]
    for r in rows:
        within(r["grad_err"], bounds["grad_err"], "LoRA gradients vs float64 (relative)", r)
    for layout in layouts:  # the stages together hold every adapter tensor
        assert {n for r in rows if r["layout"] == layout for n in r["grad_names"]} == peft_names
        last = [r for r in rows if r["layout"] == layout and "logit_diff" in r]
        assert len(last) == 4 // layout[1]  # every last-stage rank
        for r in last:
            within(r["logit_diff"], bounds["logit_diff"], "logits vs transformers", r)
            within(r["lora_logit_diff"], bounds["lora_logit_diff"], "LoRA logits vs peft", r)
            within(r["loss_diff"], bounds["loss_diff"], "LoRA loss vs peft", r)


def test_releases_under_context_parallelism(tmp_path):
    """Both releases at CP2 x TP2 (SP, full recompute) and CP2 x PP2 on packed and plain rows of 32 (the 26B-A4B's
    experts route each CP rank's tokens): logits, loss and every gradient equal one process's
    (tests/test_cp_parity.py's check). The full layers' keys, reused as values, are gathered whole with them."""
    from test_cp_parity import Layout, _run

    layouts = [Layout(2, 2, sp=True, recompute="full"), Layout(1, 2, 2)]
    folders = {name: str(save_release(name, tmp_path / name)) for name in RELEASE_CASES}
    _run(4, folders, layouts, list(folders))


def test_26b_a4b_trains_at_tp2_and_exports(tmp_path):
    """5 trainer steps (full fine-tuning, fp32, packed alpaca rows of 64 tokens) of the 26B-A4B shape at TP2: the
    export holds the source's tensors, trained, but each layer's `layer_scalar` (frozen, as transformers' buffer)
    unchanged, and loads in transformers."""
    from test_families import train_5_steps

    model = save_release("gemma-4-26B-A4B", tmp_path / "m")
    hf = train_5_steps(model, tmp_path / "out", tp=2)
    before, after = load_file(model / "model.safetensors"), load_file(hf / "model.safetensors")
    assert sorted(before) == sorted(after)
    for name in ("model.layers.5.self_attn.k_proj.weight", "model.layers.0.router.per_expert_scale",
                 "model.layers.0.experts.gate_up_proj", "model.layers.0.pre_feedforward_layernorm_2.weight"):
        assert not torch.equal(before[name], after[name]), name
    assert all(torch.equal(before[n], after[n]) for n in before if n.endswith("layer_scalar"))
    assert type(AutoModelForCausalLM.from_pretrained(hf)).__name__ == "Gemma4ForCausalLM"


def test_26b_a4b_as_its_published_multimodal_wrapper(tmp_path):
    """The release is published as `Gemma4ForConditionalGeneration` (vision tower beside the language model): with the
    shrunk 26B-A4B text config under `text_config`, HF -> TP2 x PP2 shards -> HF is bit-exact, vision tower included,
    and the language model's logits on text are the wrapper class's."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    from hfmeg.checkpoint.parity import reference_outputs

    text = json.loads((RELEASES / "gemma-4-26B-A4B.json").read_text())["config"]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2, position_embedding_size=64)
    torch.manual_seed(0)
    Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=vision, audio_config=None)) \
        .save_pretrained(tmp_path / "src")
    hf_to_mp(tmp_path / "src", tmp_path / "mp", tp=2, pp=2)
    mp_to_hf(tmp_path / "mp", tmp_path / "back")
    assert assert_same_tensors(tmp_path / "src", tmp_path / "back") > 0
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(3))  # no image tokens
    want, _ = reference_outputs(tmp_path / "src", ids, 1)
    with torch.no_grad():
        got = load_chunks(HFCheckpoint(tmp_path / "src"), make_ps(world=1))[0](ids)[..., :512]
    within((got - want).abs().max().item(), logit_bound(tmp_path / "src", ids, want), "wrapped logits vs transformers")
