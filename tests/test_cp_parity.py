"""Context parallelism: fp32 logits, loss and every gradient equal one process's.

Two gloo worlds, one spawn each, run every layout of a list in turn on rows packed with
several documents and padding and on plain rows, for LLaMA-3 (GQA, RoPE) and GPT-2 (MHA,
learned positions, biases, LayerNorm, tied embeddings) tiny checkpoints, and on 4 ranks for SmolLM3 (layers
without RoPE, a sliding window on those layers shorter than the documents), Gemma 2 (soft-capped scores under the
split mask), Gemma 3 (RoPE per layer type), Phi-3 (fused HF projections, RoPE on part of each head) and gpt-oss
(attention sinks, biased experts):

- 4 ranks (`LAYOUTS_4`): CP4 (selective recompute), CP2 x TP2 (sequence parallelism, full
  recompute), CP2 x PP2 (1F1B through `forward_backward`) and CP2 (x DP2);
- 8 ranks (`LAYOUTS_8`, 4-layer models): CP4 x TP2 + SP, CP4 x PP2 under GPipe, CP2 x TP2 + SP
  x PP2 under 1F1B, and CP2 x PP2 x VPP2 (x DP2) under the interleaved schedule, the pipelined
  ones over two micro-batches of one row.

The reference is the same checkpoint in one process (`world=1`), whose own parity with
transformers is tests/test_tp_parity.py's and, for packed rows, tests/test_attention.py's.
Gradients are compared per HF tensor, rebuilt from TP shards by the conversion's own `to_hf`.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from bounds import parity_bounds, within
from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks, source_config
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.data.microbatch import MicroBatch, token_index
from hfmeg.parallel.comm import sync_sequence_parallel_grads
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.roles import named_roles
from hfmeg.parallel.stored_names import stored_tensors
from tiny_models import save_tiny


class Layout(NamedTuple):
    """One case; DP is what the world leaves (every DP rank gets the same rows)."""

    tp: int
    cp: int
    pp: int = 1
    sp: bool = False
    recompute: str = "none"  # selective / full rerun the K/V all-gather in backward
    vpp: int = 1
    schedule: str = "1f1b"
    micro: int = 1  # micro-batches the two rows are cut into
    pp_first: int | None = None  # PP 2: the layers of the first stage (None: an even split)


LAYOUTS_4 = [Layout(1, 4, recompute="selective"), Layout(2, 2, sp=True, recompute="full"), Layout(1, 2, 2),
             Layout(1, 2)]
LAYOUTS_8 = [Layout(2, 4, sp=True, recompute="selective"), Layout(1, 4, 2, schedule="gpipe", micro=2),
             Layout(2, 2, 2, sp=True, recompute="full", micro=2),
             Layout(1, 2, 2, vpp=2, schedule="interleaved", micro=2)]
SEQ = 32  # 8 chunks of 4 at CP4


def _packed_batch() -> MicroBatch:
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
    return MicroBatch(input_ids=ids, labels=labels, position_ids=pos, segment_ids=seg)


def _plain_batch() -> MicroBatch:
    ids = torch.randint(0, 300, (2, SEQ), generator=torch.Generator().manual_seed(4))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    return MicroBatch(input_ids=ids, labels=labels)


def _rows(mb: MicroBatch, rows: slice) -> MicroBatch:
    """Rows `rows` of every tensor of `mb`."""
    return replace(mb, **{f.name: t[rows] for f in fields(mb) if isinstance(t := getattr(mb, f.name), torch.Tensor)})


def _gather(t: torch.Tensor, group, size: int, dim: int = 0) -> list[torch.Tensor]:
    if size == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def _hf_grads(chunk, ps) -> dict[str, torch.Tensor]:
    """{HF name (an expert's slice of a stacked tensor: `name[e]`): gradient}."""
    grads = stored_tensors(chunk, lambda p: p.grad)
    out = {}
    for rule in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process, chunk.experts):
        if grads[rule.local] is None:  # a frozen tensor (Gemma 4's layer_scalar)
            continue
        for name, g in to_hf(rule, _gather(grads[rule.local], ps.tp_group, ps.tp), chunk.cfg).items():
            out[name if rule.expert is None else f"{name}[{rule.expert}]"] = g
    return out


def _reference(folder, mb, ntok, dtype=torch.float32):
    chunk = load_chunks(HFCheckpoint(folder), make_ps(world=1), dtype=dtype)[0]
    kwargs = dict(position_ids=mb.position_ids, segment_ids=mb.segment_ids)
    logits = chunk(mb.input_ids, **kwargs)[..., : chunk.cfg.vocab_size].detach()
    loss = chunk(mb.input_ids, labels=mb.labels, **kwargs).sum() / ntok
    loss.backward()
    return logits, loss.item(), _hf_grads(chunk, make_ps(world=1))


def _logits(chunks, ps, local: MicroBatch) -> torch.Tensor | None:
    """This rank's tokens' logits (its TP part): the model chunks in virtual order, the hidden states
    sent from stage to stage; None where the last model chunk is not this rank's."""
    kwargs = dict(position_ids=local.position_ids, segment_ids=local.segment_ids,
                  row_segment_ids=local.row_segment_ids)
    b, s = local.shape
    x, last = local.input_ids, len(chunks) * ps.pp - 1
    for m in range(ps.pp_rank, last + 1, ps.pp):  # model chunk m = v * pp + pp_rank is chunks[v]
        if m > 0:
            x = torch.empty(s // ps.tp if ps.sequence_parallel else s, b, chunks[0].stage_width)
            dist.recv(x, ps.prev_rank)
        x = chunks[m // ps.pp](x, **kwargs).detach()
        if m < last:
            dist.send(x.contiguous(), ps.next_rank)
    return x if ps.pp_rank == (last % ps.pp) else None


def _load(folder, lay: Layout, ps):
    split = None if lay.pp_first is None else [lay.pp_first, source_config(HFCheckpoint(folder)).num_layers - lay.pp_first]
    return load_chunks(HFCheckpoint(folder), ps, recompute=lay.recompute, pp_layers=split)


def _one_layout(chunks, ps, lay: Layout, mb: MicroBatch, ntok: int, ref_logits, ref_loss, ref_grads) -> dict:
    for chunk in chunks:  # the layout's chunks serve both batches: each starts from no gradient
        chunk.zero_grad(set_to_none=True)
    row = dict(layout=lay, rank=ps.rank, last_stage=ps.is_last_stage)
    logits = _logits(chunks, ps, mb.shard(ps.cp_rank, ps.cp))  # this rank's tokens, against the reference's
    if logits is not None:
        logits = torch.cat(_gather(logits, ps.tp_group, ps.tp), dim=-1)[..., : chunks[0].cfg.vocab_size]
        mine = ref_logits.index_select(1, token_index(SEQ, lay.cp, ps.cp_rank))
        row["logit_diff"] = (logits - mine).abs().max().item()
    rows = mb.shape[0] // lay.micro
    micro = [_rows(mb, slice(i * rows, (i + 1) * rows)).shard(ps.cp_rank, ps.cp) for i in range(lay.micro)]
    loss = forward_backward(chunks, ps, micro, schedule=lay.schedule, num_tokens=ntok)
    box = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
    if ps.cp > 1:  # (a layout without CP is compared too: a pipeline split's, tests/test_gemma4_small_releases.py)
        dist.all_reduce(box, group=ps.cp_group)  # each CP rank holds its tokens' share of the sum
    sync_sequence_parallel_grads(chunks, ps)
    grads = {}
    for chunk in chunks:
        for p in chunk.parameters():  # partial sums over tokens, as DP replicas' are
            if p.requires_grad and ps.cp > 1:
                dist.all_reduce(p.grad, group=ps.cp_group)
        for _, p, role in named_roles(chunk):  # tied embeddings with PP: the stages' copies sum (roles.py)
            if role.tied and ps.pp > 1:
                dist.all_reduce(p.grad, group=ps.embedding_group)
        grads.update(_hf_grads(chunk, ps))
    if ps.is_last_stage:
        row["loss_diff"] = abs(box.item() - ref_loss)
    row["grad_rel"] = max(((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12)).item()
                          for n, g in grads.items())
    row["grads"] = sorted(grads)
    return row


BATCHES = (("packed", _packed_batch), ("plain", _plain_batch))


def _run_layouts(folders: dict[str, str], layouts: list[Layout], refs: dict) -> list[dict]:
    """Every (layout, model, batch) case in turn on this rank, against the one-process fp32 run of `refs`; a row per
    case. The DP copies of a layout (dp_rank > 0, every replica given the same rows) would repeat copy 0's work
    exactly: they only create the layout's groups, as every rank must."""
    report = []
    for lay in layouts:
        ps = make_ps(tp=lay.tp, cp=lay.cp, pp=lay.pp, vpp=lay.vpp, sp=lay.sp)
        if ps.dp_rank > 0:
            continue
        for kind, folder in folders.items():
            chunks = _load(folder, lay, ps)
            for name, make in BATCHES:
                mb = make()
                ref_logits, ref_loss, ref_grads = refs[(kind, name)][0]
                row = _one_layout(chunks, ps, lay, mb, mb.label_tokens(), ref_logits, ref_loss, ref_grads)
                report.append(dict(row, kind=kind, batch=name, all_grads=sorted(ref_grads)))
    return report


def _references(folders: dict[str, str]) -> dict[tuple[str, str], tuple]:
    """{(model, batch): the one-process run in fp32 and in float64}, computed once, in the test process."""
    refs = {}
    for name, make in BATCHES:
        mb = make()
        for kind, folder in folders.items():
            refs[(kind, name)] = tuple(_reference(folder, mb, mb.label_tokens(), dtype)
                                       for dtype in (torch.float32, torch.float64))
    return refs


def _run(world: int, folders: dict[str, str], layouts: list[Layout], kinds) -> None:
    """The layouts of `layouts` on `world` ranks, checked (`_check`) against the references."""
    refs = _references(folders)
    _check(spawn(_run_layouts, world, folders, layouts, refs), layouts, kinds, refs)


def _check(results: list[list[dict]], layouts: list[Layout], kinds, refs) -> None:
    """Each case's bounds (bounds.parity_bounds) from the one-process reference in fp32 and float64; a layout's loss
    adds CP x micro-batches fp32 partial losses."""
    covered, losses = {}, set()
    bounds = {(kind, name, lay): parity_bounds(ref32, ref64, partial_losses=lay.cp * lay.micro)
              for (kind, name), (ref32, ref64) in refs.items() for lay in layouts}
    for report in results:
        for row in report:
            # fp32 sums of the same terms in another order: within rounding of the float64 run
            bound = bounds[(row["kind"], row["batch"], row["layout"])]
            for what in ("logit_diff", "loss_diff", "grad_rel"):
                within(row.get(what, 0.0), bound[what], what, row)
            assert ("logit_diff" in row) == ("loss_diff" in row) == row["last_stage"], row
            key = (row["kind"], row["batch"], row["layout"])
            covered.setdefault(key, (row["all_grads"], set()))[1].update(row["grads"])
            if "loss_diff" in row:
                losses.add(key)
    assert len(covered) == 2 * len(kinds) * len(layouts)
    for key, (every, names) in covered.items():
        assert sorted(names) == every, key  # every gradient was compared, on some stage
    assert losses == set(covered)  # and every case's loss, on its last stage


@pytest.mark.parametrize("kind", ["llama3", "gpt2", "smollm3", "phi3", "gemma2", "gemma3"])
def test_cp_parity_with_one_process(tiny_checkpoints, kind):
    _run(4, {kind: str(tiny_checkpoints[kind])}, LAYOUTS_4, [kind])


def test_cp_parity_of_gpt_oss_sinks_and_experts(tmp_path):
    """gpt-oss under CP: each head's sink joins each query's normaliser once (the keys are gathered whole), its
    window layer under the split mask, its biased experts routing each CP rank's tokens (the load-balancing loss,
    refused under CP, off)."""
    folder = save_tiny("gpt_oss", tmp_path / "gpt_oss", output_router_logits=False)
    _run(4, {"gpt_oss": str(folder)}, LAYOUTS_4, ["gpt_oss"])


def test_cp_parity_on_eight_ranks_with_tp_pp_and_every_schedule(tmp_path):
    """CP4 x TP2, CP4 x PP2, CP2 x TP2 x PP2 and CP2 x PP2 x VPP2: both models in one spawn of 8 ranks."""
    kinds = ("llama3", "gpt2")
    folders = {k: str(save_tiny(k, tmp_path / k, num_hidden_layers=4)) for k in kinds}  # 2 stages x 2 chunks
    _run(8, folders, LAYOUTS_8, kinds)
