"""LoRA and DoRA on the TP x PP layers vs `peft` on transformers (fp32): logits, loss, every adapter gradient.

One 4-process gloo world per model family runs TP in {1, 2} x PP in {1, 2}, TP4, and TP2
and TP4 with sequence parallelism (an 8-process one TP4 x PP2, with and without SP, for LLaMA) (DP fills the rest; every replica runs the same batch,
so no DP sum is involved): LoRA and DoRA, with and without rank-stabilised scaling
(DoRA's row-parallel norm needs the TP sum), and LoRA with the vocab-parallel embedding
and LM head trained in full (`modules_to_save`). The adapter is one `peft` made with A
and B both random (`init_lora_weights=False`), read through `peft.init_from`'s path, so
every adapter gradient is non-zero and the import is exercised too; at TP2 x PP2, TP4 and TP4 x PP2
the imported shards are written and exported back, bit for bit the file `peft` wrote.
Gradients of TP-split adapter tensors are gathered with the same `join_slices` the
export uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from bounds import within
from helpers import make_ps
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
# fp32 sums of <= 300 products of O(1) terms: differences of a few 1e-6; the issue's bound is 1e-4. Qwen3.5's
# linear-attention adapters come to 7.6e-5 (in_proj_b's A, through the decay's exp and the delta rule's solve):
# transformers' own chunked and token-by-token torch forms differ by 1.3e-4 there (fp32 floor of that arithmetic).
TOL = 1e-4


def _reference(base, adapter, ids, labels):
    model = peft_reference(base, adapter)
    logits = model(ids).logits
    per_token = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    loss = per_token / (labels != -100).sum()
    loss.backward()
    base_logits = model.get_base_model()
    with model.disable_adapter():
        plain = base_logits(ids).logits
    return logits.detach(), loss.item(), peft_adapter_grads(model), (logits - plain).abs().max().item()


def _check(cases, ids, layouts=LAYOUTS):
    labels = torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)
    report, names = [], {}
    for base, adapter in cases:
        ref_logits, ref_loss, ref_grads, effect = _reference(base, adapter, ids, labels)
        names[adapter] = sorted(ref_grads)
        for tp, pp, sp in layouts:
            ps = make_ps(tp=tp, pp=pp, sp=sp)
            chunks, cfg = hfmeg_chunks(base, adapter, ps)
            logits = full_logits(chunks, ps, ids)
            mb = [MicroBatch(input_ids=ids, labels=labels)]
            loss = forward_backward(chunks, ps, mb, schedule="1f1b", num_tokens=int((labels != -100).sum()))
            sync_sequence_parallel_grads(chunks, ps)
            grads = full_adapter_grads(chunks, ps)
            if not sp and (tp, pp) in ((2, 2), (4, 1), (4, 2)):  # a peft-made adapter imported onto shards, exported back
                shards = Path(f"{adapter}_shards_tp{tp}pp{pp}")
                write_adapter_shard(chunks, ps, shards / f"mp_rank_{ps.tp_rank:02d}_{ps.pp_rank:03d}")
                dist.barrier()
                if ps.rank == 0:
                    back = write_peft_folder(Path(f"{shards}_back"), assemble(shards), cfg, str(base))
                    source, again = (load_file(str(Path(f) / WEIGHTS_FILE)) for f in (adapter, back))
                    exact = source.keys() == again.keys() and all(torch.equal(source[k], again[k]) for k in source)
                    assert exact, "import + export is not bit-exact"
            report.append(dict(
                case=adapter, tp=tp, pp=pp, sp=sp, effect=effect,
                logit_diff=None if logits is None else (logits - ref_logits).abs().max().item(),
                loss_diff=None if loss is None else abs(loss - ref_loss),
                grad_rel=max(rel_diff(g, ref_grads[k]) for k, g in grads.items()), grads=sorted(grads)))
    return report, names


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
    results = spawn(_check, 4, [(str(b), str(a)) for b, a in cases], ids)
    _assert_parity(results, cases, LAYOUTS)


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
    _assert_parity(spawn(_check, 8, [(str(b), str(a)) for b, a in cases], ids, layouts), cases, layouts)


def _assert_parity(results, cases, layouts):
    names = results[0][1]
    for (tp, pp, sp) in layouts:
        for base, adapter in cases:
            rows = [row for rank, (rep, _) in enumerate(results) for row in rep
                    if (row["tp"], row["pp"], row["sp"]) == (tp, pp, sp) and row["case"] == str(adapter)]
            assert all(r["effect"] > 1e-2 for r in rows), "the adapter must change the logits for the test to bite"
            assert any(r["logit_diff"] is not None for r in rows)
            for r in rows:
                if r["logit_diff"] is not None:
                    within(r["logit_diff"], TOL, "logit_diff", r)
                if r["loss_diff"] is not None:
                    within(r["loss_diff"], 1e-5, "loss_diff", r)
                within(r["grad_rel"], TOL, "grad_rel", r)
            # Together the stages compared every gradient peft has.
            assert sorted({g for r in rows for g in r["grads"]}) == names[str(adapter)], (tp, pp, adapter)


@pytest.mark.parametrize("options", [dict(dora=True), dict(modules_to_save=["embed_tokens", "lm_head"])])
@pytest.mark.parametrize("kind", ["llama3", "qwen3", "phi3", "qwen3_5"])
def test_merge_matches_peft_on_the_base(kind, options, tmp_path):
    """The merged folder of a DoRA adapter (rows rescaled to the magnitudes), or of a LoRA one with modules
    trained in full (they replace the base's), loads alone and computes what peft computes with the adapter
    on the base."""
    base, adapter = make_base_and_adapter(tmp_path, kind, **options)
    # fp32 rounding of the merged weights (~1e-7 relative) through 2 layers; the contract's bound is 1e-4.
    within(merged_vs_peft(base, adapter, tmp_path / "merged"), TOL, "merged logits max-abs", None)


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
