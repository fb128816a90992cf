"""LoRA and DoRA on the TP x PP layers vs `peft` on transformers (fp32): logits, loss, every adapter gradient.

One 4-process gloo world per model family runs TP in {1, 2} x PP in {1, 2}, TP4, and TP2
and TP4 with sequence parallelism (an 8-process one TP4 x PP2, with and without SP, for LLaMA) (DP fills the rest; every replica runs the same batch,
so no DP sum is involved): LoRA and DoRA, with and without rank-stabilised scaling
(DoRA's row-parallel norm needs the TP sum), and LoRA with the vocab-parallel embedding
and LM head trained in full (`modules_to_save`). The adapter is one `peft` made with A
and B both random (`init_lora_weights=False`), read through `peft.init_from`'s path, so
every adapter gradient is non-zero and the import is exercised too; at TP2 x PP2, TP4 and TP4 x PP2
the imported shards are written and exported back, bit for bit the file `peft` wrote.
Gradients of TP-split adapter tensors are gathered with the same split kinds (`AdapterTensor.split.join`) the
export uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from bounds import within
from helpers import make_ps, next_token_labels
from optim_harness import FP32_EPS, ROUNDING_FACTOR
from peft_helpers import (
    merged_vs_peft,
    full_adapter_grads,
    hfmeg_chunks,
    make_base_and_adapter,
    peft_adapter_grads,
    peft_reference,
    rel_diff,
)
from safetensors.torch import load_file
from tiny_models import tiny_config

from hfmeg.data.microbatch import MicroBatch
from hfmeg.errors import UnsupportedConfigError
from hfmeg.families import model_config_from_hf
from hfmeg.models.generate import full_logits
from hfmeg.parallel.comm import sync_sequence_parallel_grads
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.peft.adapter_files import (
    WEIGHTS_FILE,
    assemble,
    write_adapter_shard,
    write_peft_folder,
)
from hfmeg.peft.adapters import check_model
from hfmeg.peft.config import PeftConfig

LAYOUTS = [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False), (2, 1, True), (2, 2, True),
           (4, 1, False), (4, 1, True)]  # tp, pp, sp
# The parity bounds are derived, not fixed (`_references`): float64 runs are the truth, and each fp32 result
# may be ROUNDING_FACTOR times as far from one as an fp32 run of the same arithmetic is (optim_harness: two fp32
# runs' distances from float64 are the same size, not the same), + a few eps of the value's size. Qwen3.5's
# linear-attention adapters are the widest case: through the decay's exp and the delta rule's triangular solve
# in_proj_b's A is ~1e-4 from float64 in fp32 (a fixed 1e-4 between hfmeg and peft in fp32 failed by chance at
# 1.15e-4 on a loaded machine). An error of the layer (a missing TP sum, a wrong scale) moves a gradient by O(1).
# The bounds hold whatever the thread count (OMP_NUM_THREADS 1 and 2 checked): they scale with the fp32 run's own
# rounding, which another reduction order changes as it changes the layouts'.
TOL = 1e-4  # the bounds of the tests below that do not yet run a float64 reference (merge, dropout)


def _reference(base, adapter, ids, labels, dtype):
    """peft's logits, loss, adapter gradients (float64 tensors) and the adapter's effect on the logits (fp32 runs;
    None in float64)."""
    return _peft_outputs(peft_reference(base, adapter).to(dtype), ids, labels)


def _peft_outputs(model, ids, labels):
    """`_reference`'s outputs of the PeftModel `model`."""
    logits = model(ids).logits
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss = per_token / (labels != -100).sum()
    loss.backward()
    effect = None
    if logits.dtype != torch.float64:  # the adapter's effect is checked on the fp32 run (`_assert_parity`) only
        with torch.no_grad(), model.disable_adapter():
            effect = (logits - model.get_base_model()(ids).logits).abs().max().item()
    grads = {k: g.double() for k, g in peft_adapter_grads(model).items()}
    return logits.detach().double(), loss.item(), grads, effect


def _check(cases, ids, layouts=LAYOUTS, options=None):
    """Every layout's logits (last stage), loss (last stage) and full adapter gradients (each stage's),
    computed by one copy only: the DP copies of a layout (dp_rank > 0) would repeat copy 0's work exactly.
    `options` go to `load_chunks` (a 4-bit base: tests/test_qlora_parity.py)."""
    labels = next_token_labels(ids)
    report = []
    for tp, pp, sp in layouts:
        ps = make_ps(tp=tp, pp=pp, sp=sp)  # the layout's groups, created once for all its cases
        export = not sp and (tp, pp) in ((2, 2), (4, 1), (4, 2))  # a peft-made adapter imported onto shards, exported back
        for base, adapter in cases:
            if ps.dp_rank > 0:
                if export:
                    dist.barrier()
                continue
            chunks, cfg = hfmeg_chunks(base, adapter, ps, **(options or {}))
            logits = full_logits(chunks, ps, ids)
            mb = [MicroBatch(input_ids=ids, labels=labels)]
            loss = forward_backward(chunks, ps, mb, schedule="1f1b", num_tokens=int((labels != -100).sum()))
            sync_sequence_parallel_grads(chunks, ps)
            grads = full_adapter_grads(chunks, ps)
            if export:
                shards = Path(f"{adapter}_shards_tp{tp}pp{pp}")
                write_adapter_shard(chunks, ps, shards / f"mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}")
                dist.barrier()
                if ps.rank == 0:
                    back = write_peft_folder(Path(f"{shards}_back"), assemble(shards), cfg, str(base))
                    source, again = (load_file(str(Path(f) / WEIGHTS_FILE)) for f in (adapter, back))
                    exact = source.keys() == again.keys() and all(torch.equal(source[k], again[k]) for k in source)
                    assert exact, "import + export is not bit-exact"
            report.append(dict(case=adapter, tp=tp, pp=pp, sp=sp, rank=ps.rank, logits=logits, loss=loss,
                               grads=grads))
    return report


def _hfmeg_single(base, adapter, ids, dtype, options=None):
    """hfmeg's own logits, loss and adapter gradients in one process (TP1 PP1) in `dtype`, as `_reference`
    gives peft's: the float64 run checks the layers' arithmetic itself, the fp32 one measures how far fp32
    rounding takes hfmeg's form of it (e.g. Gated DeltaNet's chunked delta rule) from float64."""
    labels, ps = next_token_labels(ids), make_ps(world=1)
    chunks, _ = hfmeg_chunks(base, adapter, ps, dtype=dtype, **(options or {}))
    logits = full_logits(chunks, ps, ids)
    loss = forward_backward(chunks, ps, [MicroBatch(input_ids=ids, labels=labels)], schedule="1f1b",
                            num_tokens=int((labels != -100).sum()))
    return logits.double(), loss, {k: g.double() for k, g in full_adapter_grads(chunks, ps).items()}


def _distances(run, ref64) -> dict[str, float]:
    """A run's distances from the float64 reference, in each measure the test bounds."""
    (logits, loss, grads), (logits64, loss64, grads64) = run[:3], ref64[:3]
    return dict(logit_diff=(logits.double() - logits64).abs().max().item(), loss_diff=abs(loss - loss64),
                grad_rel=max(rel_diff(grads[k].double(), grads64[k]) for k in grads64))


def _references(cases, ids, reference=None, options=None) -> dict[str, tuple]:
    """{adapter: (hfmeg's unsharded float64 run, the layouts' bounds, the adapter's effect)}, computed once in
    the test process, after checking that run against peft's in float64.

    Two comparisons, each against a float64 run, each within ROUNDING_FACTOR times the distance of an fp32
    run of the same arithmetic from its float64 run (+ 4 eps32 of the value's size):
    - hfmeg in float64 against peft in float64, within peft's fp32 rounding: the two are not equal to
      float64 rounding, since transformers computes RoPE's angles in fp32 even in a float64 model (one fp32
      rounding of the kind, and under the size, the fp32 run has everywhere);
    - each layout (fp32, its sums split over TP and stages in another order) against hfmeg in float64,
      within hfmeg's unsharded fp32 rounding (its own form of the arithmetic, e.g. Gated DeltaNet's chunked
      delta rule, which rounds differently from transformers').
    `reference(base, adapter, dtype)`: peft's run in `dtype` (default `_reference`); `options` go to `load_chunks`
    (a 4-bit base: tests/test_qlora_parity.py)."""
    reference = reference or (lambda base, adapter, dtype: _reference(base, adapter, ids, next_token_labels(ids), dtype))
    out = {}
    for base, adapter in cases:
        ref32, ref64 = (reference(base, adapter, dtype) for dtype in (torch.float32, torch.float64))
        ours32, ours64 = (_hfmeg_single(base, adapter, ids, dtype, options) for dtype in (torch.float32, torch.float64))
        size = dict(logit_diff=ref64[0].abs().max().item(), loss_diff=abs(ref64[1]), grad_rel=1.0)
        assert sorted(ours64[2]) == sorted(ref64[2]), "hfmeg has the adapter gradients peft has"
        peft_rounding, our_rounding = _distances(ref32, ref64), _distances(ours32, ours64)
        for what, d in _distances(ours64, ref64).items():
            within(d, ROUNDING_FACTOR * peft_rounding[what] + 4 * FP32_EPS * size[what], f"float64 vs peft {what}",
                   adapter)
        bound = {k: ROUNDING_FACTOR * our_rounding[k] + 4 * FP32_EPS * size[k] for k in size}
        out[str(adapter)] = (ours64, bound, ref32[3], ours32)
    return out


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3", "smollm3", "phi3", "gemma2", "gemma4", "olmo2", "qwen3_5"])
def test_lora_and_dora_match_peft(kind, tmp_path):
    cases = [make_base_and_adapter(tmp_path, kind, rslora=rs, dora=dora)
             for rs, dora in ((False, False), (True, False), (False, True), (True, True))]
    if not tiny_config(kind).tie_word_embeddings:
        # Tied (smollm3, gemma2): peft trains a copy of embed_tokens and keeps the head on the original weight
        # (unless ensure_weight_tying), hfmeg would train the one tied weight, so it refuses them there
        # (test_modules_to_save_of_a_tied_model_is_refused).
        cases.append(make_base_and_adapter(tmp_path, kind, modules_to_save=["embed_tokens", "lm_head"]))
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    refs = _references(cases, ids)
    # TP1 x PP1 is hfmeg's unsharded fp32 run, which `_references` made in the test process: not again on a rank.
    results = spawn(_check, 4, [(str(b), str(a)) for b, a in cases], ids, LAYOUTS[1:])
    _assert_parity(results, refs, cases, LAYOUTS)


@pytest.mark.parametrize("module", ["embed_tokens", "lm_head"])
def test_modules_to_save_of_a_tied_model_is_refused(module):
    cfg = model_config_from_hf(tiny_config("smollm3"))
    assert cfg.tie_embeddings
    with pytest.raises(UnsupportedConfigError, match=f"peft.modules_to_save: {module} is tied to .* untied copy"):
        check_model(cfg, PeftConfig(method="lora", modules_to_save=[module]))
    check_model(model_config_from_hf(tiny_config("llama3")), PeftConfig(method="lora", modules_to_save=[module]))


def test_lora_and_dora_match_peft_at_tp4_pp2(tmp_path):
    """8 ranks, TP4 x PP2 with and without SP: every stage holds a quarter of each projection."""
    cases = [make_base_and_adapter(tmp_path, "llama3", dora=dora) for dora in (False, True)]
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    layouts = [(4, 2, False), (4, 2, True)]
    refs = _references(cases, ids)
    _assert_parity(spawn(_check, 8, [(str(b), str(a)) for b, a in cases], ids, layouts), refs, cases, layouts)


def _assert_parity(results, refs, cases, layouts):
    for (tp, pp, sp) in layouts:
        for base, adapter in cases:
            (logits64, loss64, grads64), bound, effect, ours32 = refs[str(adapter)]
            rows = [row for rep in results for row in rep
                    if (row["tp"], row["pp"], row["sp"]) == (tp, pp, sp) and row["case"] == str(adapter)]
            if (tp, pp, sp) == (1, 1, False):
                rows.append(dict(case=str(adapter), tp=1, pp=1, sp=False, rank=0, logits=ours32[0], loss=ours32[1],
                                 grads=ours32[2]))
            assert effect > 1e-2, "the adapter must change the logits for the test to bite"
            assert len(rows) == tp * pp, "each TP x PP place of the layout reports once (DP copy 0 only)"
            assert any(r["logits"] is not None for r in rows)
            for r in rows:
                row = dict(case=r["case"], tp=tp, pp=pp, sp=sp, rank=r["rank"])
                if r["logits"] is not None:
                    within((r["logits"].double() - logits64).abs().max().item(), bound["logit_diff"], "logit_diff", row)
                if r["loss"] is not None:
                    within(abs(r["loss"] - loss64), bound["loss_diff"], "loss_diff", row)
                within(max(rel_diff(g.double(), grads64[k]) for k, g in r["grads"].items()), bound["grad_rel"],
                       "grad_rel", row)
            # Together the stages compared every gradient peft has.
            assert sorted({g for r in rows for g in r["grads"]}) == sorted(grads64), (tp, pp, adapter)


@pytest.mark.parametrize("options", [dict(dora=True), dict(modules_to_save=["embed_tokens", "lm_head"])])
@pytest.mark.parametrize("kind", ["llama3", "qwen3", "phi3", "qwen3_5"])
def test_merge_matches_peft_on_the_base(kind, options, tmp_path):
    """The merged folder of a DoRA adapter (rows rescaled to the magnitudes), or of a LoRA one with modules
    trained in full (they replace the base's), loads alone and computes what peft computes with the adapter
    on the base."""
    base, adapter = make_base_and_adapter(tmp_path, kind, **options)
    # fp32 rounding of the merged weights through 2 layers: derived from peft's own distance from float64
    within(*merged_vs_peft(base, adapter, tmp_path / "merged"), "merged logits max-abs", None)


def test_dora_merge_matches_peft_on_a_gemma(tmp_path):
    """The merged DoRA export of Gemma 2 (tied embeddings, soft-capping, four norms) against peft on the base."""
    test_merge_matches_peft_on_the_base("gemma2", dict(dora=True), tmp_path)


def _dropout_run(base, adapter, ids):
    """Loss and full adapter gradients with adapter dropout 0.3 at TP1 and TP2 (same generator state)."""
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
    out = {}
    for tp in (1, 2):
        ps = make_ps(tp=tp)
        chunks, cfg = hfmeg_chunks(base, adapter, ps, dropout=0.3)
        torch.manual_seed(7)
        loss = forward_backward(chunks, ps, [MicroBatch(input_ids=ids, labels=labels)], schedule="1f1b",
                                num_tokens=int((labels != -100).sum()))
        sync_sequence_parallel_grads(chunks, ps)
        chunks[0].eval()
        with torch.no_grad():
            plain = full_logits(chunks, ps, ids)
        chunks[0].train()
        torch.manual_seed(7)
        with torch.no_grad():
            dropped = full_logits(chunks, ps, ids)
        out[tp] = (loss, full_adapter_grads(chunks, ps), (dropped - plain).abs().max().item())
    return out


def test_adapter_dropout_masks_do_not_depend_on_tp(tmp_path):
    """Adapter dropout draws one mask over the full input whatever the TP layout (a row-parallel base's
    shards use disjoint parts of it), so TP2 computes what TP1 does with the same generator state."""
    base, adapter = make_base_and_adapter(tmp_path, "llama3")
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    out = spawn(_dropout_run, 2, str(base), str(adapter), ids)[0]
    (loss1, grads1, effect), (loss2, grads2, _) = out[1], out[2]
    assert effect > 1e-2, "dropout must change the output for the test to bite"
    # Same masks, sums in another order: fp32 rounding only; the parity bound is 1e-4.
    within(abs(loss1 - loss2) / abs(loss1), 1e-5, "dropout loss rel")
    assert grads1.keys() == grads2.keys()
    within(max(rel_diff(grads2[k], grads1[k]) for k in grads1), TOL, "dropout grad_rel")
