"""Context parallelism: fp32 logits, loss and every gradient equal one process's.

One 4-process gloo world runs CP4 (selective recompute), CP2 x TP2 (sequence
parallelism, full recompute), CP2 x PP2 (1F1B through `forward_backward`) and CP2
(x DP2), for LLaMA-3 and GPT-2 tiny checkpoints, and CP2 x PP2 x VPP2 under the
interleaved schedule, on rows packed with several
documents and padding, and on plain rows. The reference is the same checkpoint in one
process (`world=1`), whose own parity with transformers is tests/test_tp_parity.py's
and, for packed rows, tests/test_attention.py's. Gradients are compared per HF tensor,
rebuilt from TP shards by the conversion's own `to_hf`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bounds import within
from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.parallel.comm import sync_sequence_parallel_grads
from hfmeg.parallel.context import shard_microbatch, token_index
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.roles import named_roles
from tiny_models import save_tiny

# (tp, cp, pp, sp, recompute) in a world of 4; CP2 alone leaves DP = 2 (both DP ranks get the same rows).
# Recompute reruns the K/V all-gather in backward (selective: the attention core; full: the layer).
LAYOUTS = [(1, 4, 1, False, "selective"), (2, 2, 1, True, "full"), (1, 2, 2, False, "none"),
           (1, 2, 1, False, "none")]
SEQ = 32  # 8 chunks of 4 at CP4


def _packed_batch() -> dict:
    """Two rows of 32: documents of 5, 11, 9, 7 tokens; and 20, 10 and 2 tokens of padding."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (2, SEQ), generator=gen)
    seg, pos, labels = (torch.zeros(2, SEQ, dtype=torch.long) for _ in range(3))
    labels.fill_(-100)
    for row, lengths in enumerate(((5, 11, 9, 7), (20, 10))):
        start = 0
        for doc, n in enumerate(lengths, 1):
            seg[row, start:start + n] = doc
            pos[row, start:start + n] = torch.arange(n)
            labels[row, start:start + n - 1] = ids[row, start + 1:start + n]  # no target across documents
            start += n
    return dict(input_ids=ids, labels=labels, position_ids=pos, segment_ids=seg)


def _plain_batch() -> dict:
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(4))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    return dict(input_ids=ids, labels=labels)


def _gather(t: torch.Tensor, group, size: int, dim: int = 0) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _hf_grads(chunk, ps) -> dict[str, torch.Tensor]:
    params = dict(chunk.named_parameters())
    out = {}
    for rule in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process):
        out.update(to_hf(rule, _gather(params[rule.local].grad, ps.tp_group, ps.tp), chunk.cfg))
    return out


def _reference(folder, mb, ntok):
    chunk = load_chunks(HFCheckpoint(folder), make_ps(world=1))[0]
    kwargs = {k: mb[k] for k in ("position_ids", "segment_ids") if k in mb}
    logits = chunk(mb["input_ids"], **kwargs)[..., : chunk.cfg.vocab_size].detach()
    loss = chunk(mb["input_ids"], labels=mb["labels"], **kwargs).sum() / ntok
    loss.backward()
    return logits, loss.item(), _hf_grads(chunk, make_ps(world=1))


def _run_layouts(folder):
    report = []
    for name, mb in (("packed", _packed_batch()), ("plain", _plain_batch())):
        ntok = int((mb["labels"] != -100).sum())
        ref_logits, ref_loss, ref_grads = _reference(folder, mb, ntok)
        for tp, cp, pp, sp, recompute in LAYOUTS:
            ps = make_ps(tp=tp, cp=cp, pp=pp, sp=sp)
            chunk = load_chunks(HFCheckpoint(folder), ps, recompute=recompute)[0]
            row = dict(batch=name, tp=tp, cp=cp, pp=pp, sp=sp, rank=ps.rank)
            if pp == 1:  # the logits of this rank's tokens, against the same positions of the reference
                local = shard_microbatch(mb, ps)
                kwargs = {k: local[k] for k in ("position_ids", "segment_ids") if k in local}
                logits = torch.cat(_gather(chunk(local["input_ids"], **kwargs), ps.tp_group, ps.tp), dim=-1)
                mine = ref_logits.index_select(1, token_index(SEQ, cp, ps.cp_rank))
                row["logit_diff"] = (logits[..., : chunk.cfg.vocab_size] - mine).abs().max().item()
            loss = forward_backward([chunk], ps, [shard_microbatch(mb, ps)], schedule="1f1b", num_tokens=ntok)
            box = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
            dist.all_reduce(box, group=ps.cp_group)  # each CP rank holds its tokens' share of the sum
            sync_sequence_parallel_grads([chunk], ps)
            for p in chunk.parameters():  # partial sums over tokens, as DP replicas' are
                dist.all_reduce(p.grad, group=ps.cp_group)
            for _, p, role in named_roles(chunk):  # tied embeddings with PP: the stages' copies sum (roles.py)
                if role.tied and ps.pp > 1:
                    dist.all_reduce(p.grad, group=ps.embedding_group)
            grads = _hf_grads(chunk, ps)
            if ps.is_last_stage:
                row["loss_diff"] = abs(box.item() - ref_loss)
            row["grad_rel"] = max(((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12)).item()
                                  for n, g in grads.items())
            row["grads"] = sorted(grads)
            report.append(row)
    return report, sorted(ref_grads)


@pytest.mark.parametrize("kind", ["llama3", "gpt2"])  # GQA + RoPE; MHA + learned positions, biases, LayerNorm
def test_cp_parity_with_one_process(tiny_checkpoints, kind):
    results = spawn(_run_layouts, 4, str(tiny_checkpoints[kind]))
    all_names = results[0][1]
    covered = {}
    for report, _ in results:
        for row in report:
            # fp32 sums of the same terms in another order: ~1e-6 here; the contract's bounds.
            within(row.get("logit_diff", 0.0), 1e-4, "logit_diff", row)
            within(row.get("loss_diff", 0.0), 1e-5, "loss_diff", row)
            within(row["grad_rel"], 1e-4, "grad_rel", row)
            key = (row["batch"], row["tp"], row["cp"], row["pp"])
            covered.setdefault(key, set()).update(row["grads"])
            assert "logit_diff" in row or row["pp"] > 1, row
    assert len(covered) == 2 * len(LAYOUTS)
    for key, names in covered.items():
        assert sorted(names) == all_names, key  # every gradient was compared, on some stage
    assert any("loss_diff" in row for report, _ in results for row in report)


def _interleaved(folder):
    """CP2 x PP2 with two virtual chunks per rank, the interleaved 1F1B schedule, two micro-batches of one row."""
    mb = _packed_batch()
    ntok = int((mb["labels"] != -100).sum())
    _, ref_loss, ref_grads = _reference(folder, mb, ntok)
    ps = make_ps(cp=2, pp=2, vpp=2)
    chunks = load_chunks(HFCheckpoint(folder), ps)
    micro = [shard_microbatch({k: v[i:i + 1] for k, v in mb.items()}, ps) for i in range(2)]
    loss = forward_backward(chunks, ps, micro, schedule="interleaved", num_tokens=ntok)
    box = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
    dist.all_reduce(box, group=ps.cp_group)
    grads = {}
    for chunk in chunks:
        for p in chunk.parameters():
            dist.all_reduce(p.grad, group=ps.cp_group)
        grads.update(_hf_grads(chunk, ps))
    worst = max(((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12)).item()
                for n, g in grads.items())
    return abs(box.item() - ref_loss) if ps.is_last_stage else 0.0, worst, sorted(grads), sorted(ref_grads)


def test_cp_parity_under_the_interleaved_schedule(tmp_path):
    folder = save_tiny("llama3", tmp_path / "llama4", num_hidden_layers=4)  # 2 stages x 2 virtual chunks
    results = spawn(_interleaved, 4, str(folder))
    for loss_diff, grad_rel, _, _ in results:
        within(loss_diff, 1e-5, "interleaved loss_diff", (loss_diff, grad_rel))
        within(grad_rel, 1e-4, "interleaved grad_rel", (loss_diff, grad_rel))
    assert sorted({n for *_, names, _ in results for n in names}) == results[0][3]  # every gradient compared
