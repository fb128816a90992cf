"""DPO, IPO and SimPO on the TP x PP x CP layers vs TRL's own trainers on the same model and pairs (fp32).

TRL computes its loss and metrics from its own forward of a batch it collated (`DPOTrainer.compute_loss`;
SimPO: the CPO trainer's `get_batch_loss_metrics`); the same token ids become hfmeg `PairBatch`es, each
pair's chosen and rejected sequences packed as two documents of one row, one row per micro-batch, and
go through the reference's forward-only pass and the policy's forward and backward at TP in {1, 2} x
PP in {1, 2} and at CP 2, in one 4-process gloo world (DP fills the rest, every replica runs the same
pairs). The policy is stories260K with its weights moved off the reference's (full), or with a random
LoRA adapter on it (the reference is then the base with the adapter off, as TRL switches it off), so
every log-ratio is far from 0 and the loss from log 2.

Bounds: a sequence's log-probability is a sum of n log-softmax values, each within 2 max|Δ logit| of
transformers' (`TOL`, the logits' rounding bound derived from float64 runs of the policy and the reference on
these sequences, `_logit_bound`), so it is within 2 n TOL; a reward,
β times a difference of two of them, within 4 β n TOL; the sigmoid loss (slope ≤ β in the margin, which is
a difference of two rewards' arguments) within 2 · 4 β n TOL per pair, averaged (SimPO's per-token averages
are within less); IPO's squared loss, with per-token averages (d within 8 TOL), within 2 |d − 1/(2β)| · 8 TOL. LoRA's adapter
gradients: within rounding of TRL's own, each tensor's bound derived from TRL's run repeated in float64.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from bounds import rounding_bound, within
from helpers import make_ps, stories_or_skip
from peft_helpers import full_adapter_grads, hfmeg_chunks, peft_adapter_grads, rel_diff

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data.formats import Doc
from hfmeg.data.microbatch import PairBatch
from hfmeg.data.packing import build_row
from hfmeg.parallel.comm import sync_sequence_parallel_grads
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.peft.adapters import adapters_off
from hfmeg.train.parts.reference import Reference
from hfmeg.train.preference import METRICS, PreferenceConfig, PreferenceLoss

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")

LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (2, 2, 1, 1), (1, 1, 2, 1)]  # tp, pp, cp, ep
MOE_LAYOUTS = [(1, 1, 1, 1), (1, 1, 1, 2), (2, 1, 1, 2), (1, 2, 1, 2)]
SEQ_LEN = 48
PAIRS = [("Once upon a time", " there was a cat.", " the dog ran away fast."),
         ("Lily liked", " to play with her red ball.", " apples."),
         ("The sun was", " warm and bright.", " a big yellow ball in the sky that day.")]


def _policy_and_reference(root, lora: bool):
    """(policy folder, reference folder, adapter folder or None): the policy moved off stories260K, or a random
    peft LoRA adapter on it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = stories_or_skip()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(0)
    if lora:
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
        get_peft_model(model, cfg).save_pretrained(root / "adapter")
        return base, base, root / "adapter"
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
    model.save_pretrained(root / "policy")
    return root / "policy", base, None


def _moe_policy_and_reference(root):
    """A tiny Qwen3-MoE (stories260K's vocabulary, so TRL tokenises with its tokenizer) and a copy moved off it.
    No router loss: TRL adds one wherever the coefficient is non-zero, over its whole padded batch; hfmeg where
    the config's `output_router_logits` asks, per micro-batch."""
    from tiny_models import save_tiny
    from transformers import AutoModelForCausalLM

    reference = save_tiny("qwen3_moe", root / "moe_reference", vocab_size=512, output_router_logits=False,
                          router_aux_loss_coef=0.0)
    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * p.std() * torch.randn_like(p))
        model.lm_head.weight.mul_(30)  # a random tiny model's next-token distributions are near uniform
    model.save_pretrained(root / "moe_policy")
    return root / "moe_policy", reference, None


def _trl_models(policy, reference, adapter, dtype: torch.dtype = torch.float32):
    """(policy, reference or None) as TRL takes them: fp32, or converted to float64 after loading (`dtype`)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # transformers' grouped-GEMM experts have no float64 kernel; its eager loop is the same arithmetic
    load = {} if dtype == torch.float32 else {"experts_implementation": "eager"}
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32, **load)
    if adapter is not None:
        return PeftModel.from_pretrained(model, adapter, is_trainable=True).to(dtype), None
    return model.to(dtype), AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32, **load).to(dtype)


def _logit_bound(policy, reference, adapter, sequences) -> float:
    """`TOL` of the module doc, derived: how far an fp32 run's logits of `sequences` may be from transformers'
    (peft's, with the adapter) by rounding alone, the worst of the policy's and the reference's
    (bounds.rounding_bound: their fp32 run against the same run in float64, two fp32 runs compared). The sequences
    are padded on the right (causal: no real position sees the padding), which is left out."""
    n = max(len(ids) for ids, _ in sequences)
    ids = torch.tensor([x + [0] * (n - len(x)) for x, _ in sequences])
    real = torch.tensor([[True] * len(x) + [False] * (n - len(x)) for x, _ in sequences])
    logits = []
    for dtype in (torch.float32, torch.float64):
        model, ref = _trl_models(policy, reference, adapter, dtype)
        with torch.no_grad():
            if ref is None:  # the reference is the base with the adapter off
                with model.disable_adapter():
                    off = model(ids).logits
            else:
                off = ref(ids).logits
            logits.append((model(ids).logits[real], off[real]))
    return max(rounding_bound(a, b) for a, b in zip(*logits))


def _trl_dpo(policy, reference, adapter, cfg: PreferenceConfig, out, tokenizer, dtype: torch.dtype = torch.float32):
    """TRL's DPOTrainer on PAIRS: its collated batch as (prompt+answer ids, answer mask) per sequence, chosen
    ones first; its loss and metrics; and (LoRA) its adapter gradients. `dtype` float64: the same run in float64
    (the truth the gradients' bound is derived from)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    model, ref = _trl_models(policy, reference, adapter, dtype)
    losses = ["sigmoid", "sft"] if cfg.rpo_alpha else [cfg.loss_type]
    args = DPOConfig(output_dir=str(out), beta=cfg.beta, loss_type=losses, loss_weights=[1.0, cfg.rpo_alpha]
                     if cfg.rpo_alpha else None, report_to="none", per_device_train_batch_size=len(PAIRS),
                     use_cpu=True, max_length=None, bf16=False)
    records = [dict(prompt=p, chosen=c, rejected=r) for p, c, r in PAIRS]
    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(records),
                         processing_class=AutoTokenizer.from_pretrained(tokenizer))
    if adapter is not None:
        # Given a PeftModel, TRL's reference is a frozen copy of its adapter as it starts ("ref"); without that
        # copy it is the base with the adapters off (TRL's path for a fresh adapter), which is hfmeg's reference.
        trainer.model.delete_adapter("ref")
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k in METRICS}
    sequences = [(ids[m.bool()].tolist(), c[m.bool()].tolist()) for ids, m, c in
                 zip(batch["input_ids"], batch["attention_mask"], batch["completion_mask"])]
    grads = peft_adapter_grads(trainer.model) if adapter is not None else None
    return sequences, loss.item(), metrics, grads


def _trl_simpo(policy, reference, adapter, cfg: PreferenceConfig, out, tokenizer,
               dtype: torch.dtype = torch.float32):
    """SimPO as TRL has it, its CPO trainer with loss_type simpo (reference-free; `cpo_alpha` is hfmeg's
    `rpo_alpha`): the same outputs as `_trl_dpo`."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    model, _ = _trl_models(policy, reference, adapter, dtype)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    tokenizer.pad_token = tokenizer.eos_token  # its collator pads; the padding is masked out
    args = CPOConfig(output_dir=str(out), loss_type="simpo", beta=cfg.beta, simpo_gamma=cfg.simpo_gamma,
                     label_smoothing=cfg.label_smoothing, cpo_alpha=cfg.rpo_alpha, report_to="none",
                     per_device_train_batch_size=len(PAIRS), use_cpu=True, bf16=False)
    records = [dict(prompt=p, chosen=c, rejected=r) for p, c, r in PAIRS]
    trainer = CPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(records), processing_class=tokenizer)
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.model.train()
    loss, metrics = trainer.get_batch_loss_metrics(trainer.model, batch)
    loss.backward()
    sequences = [(ids[m.bool()].tolist(), (labels != -100)[m.bool()].tolist()) for side in ("chosen", "rejected")
                 for ids, m, labels in zip(batch[f"{side}_input_ids"], batch[f"{side}_attention_mask"],
                                           batch[f"{side}_labels"])]
    grads = peft_adapter_grads(trainer.model) if adapter is not None else None
    return sequences, loss.item(), {k: v for k, v in metrics.items() if k in METRICS}, grads


def _pair_batches(sequences, pad_id: int) -> list[PairBatch]:
    """One micro-batch per pair: its chosen and rejected sequences packed in one row (two documents)."""
    n = len(sequences) // 2
    out = []
    for p in range(n):
        docs = [Doc(np.array(ids), np.array(mask, dtype=bool)) for ids, mask in (sequences[p], sequences[n + p])]
        row = build_row(docs, SEQ_LEN, pad_id)
        seq = np.where(row["labels"] != -100, row["segment_ids"] - 1, -1)  # documents 1, 2 -> sequences 0, 1
        out.append(PairBatch(num_pairs=1, sequence_ids=torch.from_numpy(seq)[None],
                             **{k: torch.from_numpy(v)[None] for k, v in row.items()}))
    return out


def _run_layouts(policy, reference, adapter, runs, pad_id: int, layouts):
    """Each case of `runs` (sequences, settings, chosen tokens) at each layout, the layout's chunks loaded once for
    all of them; a row per (case, layout). The DP copies of a layout beyond the first (dp_rank >= ep: the EP ranks
    of one copy hold its experts between them), every copy given the same pairs, would repeat copy 0's work exactly:
    they only create the layout's groups, as every rank must."""
    rows = []
    for tp, pp, cp, ep in layouts:
        ps = make_ps(tp=tp, pp=pp, cp=cp, ep=ep)
        if ps.dp_rank >= ps.ep:
            continue
        if adapter is not None:
            chunks, _ = hfmeg_chunks(policy, adapter, ps)
            ref = Reference(chunks, lambda: adapters_off(chunks))
        else:
            chunks = load_chunks(HFCheckpoint(policy), ps)
            ref = Reference(load_chunks(HFCheckpoint(reference), ps))
        for i, (sequences, cfg, chosen_tokens) in enumerate(runs):
            for chunk in chunks:  # each case's gradients from none
                chunk.zero_grad(set_to_none=True)
            mbs = [mb.shard(ps.cp_rank, cp) for mb in _pair_batches(sequences, pad_id)]
            if cfg.needs_reference:
                mbs = ref.annotate(mbs, ps, "1f1b", ("train", 0))
            objective = PreferenceLoss(cfg, ps, len(mbs), chosen_tokens)
            loss = forward_backward(chunks, ps, mbs, schedule="1f1b", loss=objective)
            sync_sequence_parallel_grads(chunks, ps)
            grads = full_adapter_grads(chunks, ps) if adapter is not None else {}
            if cp > 1:  # each CP rank holds half of every sequence's gradient
                for g in grads.values():
                    torch.distributed.all_reduce(g, group=ps.cp_group)
            rows.append(dict(case=i, layout=(tp, pp, cp, ep), loss=None if loss is None else loss * cp,
                             metrics=objective.metrics(objective.totals) if ps.is_last_stage else None, grads=grads))
    return rows


CASES = [("sigmoid", {}), ("sigmoid", dict(rpo_alpha=0.5)), ("ipo", {}), ("simpo", {}),
         ("simpo", dict(label_smoothing=0.1, rpo_alpha=0.5))]


def _check(policy, reference, adapter, cases, layouts, root):
    from transformers import AutoTokenizer

    tokenizer = stories_or_skip()
    pad_id = AutoTokenizer.from_pretrained(tokenizer).eos_token_id
    runs, wants, tols = [], [], {}
    for loss_type, options in cases:
        cfg = PreferenceConfig(loss_type=loss_type, beta=0.1, **options)
        trl_run = _trl_simpo if loss_type == "simpo" else _trl_dpo
        sequences, want_loss, want, want_grads = trl_run(policy, reference, adapter, cfg, root / "trl", tokenizer)
        if str(sequences) not in tols:  # the DPO cases share their sequences, the SimPO ones theirs
            tols[str(sequences)] = _logit_bound(policy, reference, adapter, sequences)
        tol = tols[str(sequences)]
        grad_bounds = {}
        if want_grads is not None:  # TRL's own fp32 gradients against its float64 run: two fp32 runs compared
            grads64 = trl_run(policy, reference, adapter, cfg, root / "trl64", tokenizer, torch.float64)[3]
            grad_bounds = {k: rounding_bound(g, grads64[k]) / grads64[k].abs().max().item()
                           for k, g in want_grads.items()}
        n = max(len(ids) for ids, _ in sequences)
        chosen_tokens = sum(sum(m[1:]) for _, m in sequences[:len(PAIRS)])
        if cfg.needs_reference:
            assert abs(want["rewards/margins"]) > 0.05, "the log-ratios must be far from 0 for the test to bite"
        runs.append((sequences, cfg, chosen_tokens))
        wants.append((want_loss, want, want_grads, tol, grad_bounds, n))
    # every case in one world: each layout's groups and chunks made once
    results = spawn(_run_layouts, 4, str(policy), str(reference), adapter and str(adapter), runs, pad_id, layouts)
    for i, ((loss_type, options), (sequences, cfg, _), (want_loss, want, want_grads, tol, grad_bounds, n)) in enumerate(
            zip(cases, runs, wants)):
        reward_bound = 4 * cfg.beta * n * tol
        # IPO: |d - 1/(2 beta)| of every pair is at most sqrt(pairs x TRL's mean squared loss).
        loss_bound = (2 * (want_loss * len(PAIRS)) ** 0.5 * 8 * tol if loss_type == "ipo" else 8 * cfg.beta * n * tol)
        loss_bound += cfg.rpo_alpha * 2 * tol  # a mean of log-probabilities, each within 2 TOL
        for layout in layouts:
            rows = [r for rank in results for r in rank if r["layout"] == layout and r["case"] == i]
            assert any(r["loss"] is not None for r in rows)
            for r in rows:
                where = (loss_type, options, layout)
                if r["loss"] is not None:
                    within(abs(r["loss"] - want_loss), loss_bound, "dpo loss vs trl", where)
                    for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
                        within(abs(r["metrics"][k] - want[k]), 2 * reward_bound, f"{k} vs trl", where)
                    for k in ("logps/chosen", "logps/rejected"):
                        within(abs(r["metrics"][k] - want[k]), 2 * n * tol, f"{k} vs trl", where)
                    assert r["metrics"]["rewards/accuracies"] == pytest.approx(want["rewards/accuracies"])
                if want_grads is not None and r["grads"]:
                    for k, g in r["grads"].items():
                        within(rel_diff(g, want_grads[k]), grad_bounds[k], "dpo lora grad_rel", (where, k))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_dpo_matches_trl(lora, tmp_path):
    _check(*_policy_and_reference(tmp_path, lora), CASES, LAYOUTS, tmp_path)


def test_dpo_on_moe_experts_matches_trl(tmp_path):
    """A Qwen3-MoE policy and its frozen reference with the experts spread over EP 2 ranks (and TP, PP)."""
    _check(*_moe_policy_and_reference(tmp_path), CASES[:1], MOE_LAYOUTS, tmp_path)
