"""Staging (models/staging.py): a step's micro-batches on the device with their attention decided once per
micro-batch, in the data prefetch thread, so the step builds no mask.

On CPU the model attends packed rows with the dense mask (flex_attention has no backward there), so the
flex block masks are staged here by a `Stager` whose planner is told to (`flex=True`) and checked forward
only; the CUDA test runs the trainer's own stager, forward and backward. Under CP the keys' document ids come
from the whole rows a micro-batch carries: checked here without a process group, so with no collective."""

from __future__ import annotations

import copy
import threading
from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import hfmeg.models.document_attention as document_attention
import hfmeg.models.staging as staging
from bounds import assert_close, within
from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data import MicroBatch, build_data
from hfmeg.data.packing import single_document
from hfmeg.errors import LayoutError
from hfmeg.models.document_attention import MaskPlanner, document_causal_mask, split_causal_mask
from hfmeg.models.staging import Stager, stage_microbatch
from hfmeg.parallel.context import gathered_index, token_index
from hfmeg.parallel.pipeline import forward_backward
from optim_harness import FP32_EPS, ROUNDING_FACTOR
from test_data import char_tokenizer
from test_data_batches import mixed_config
from tiny_models import save_tiny

SEQ = 256


def _data(tmp_path, prefetch: int, stage=None):
    cfg = replace(mixed_config(tmp_path, seq_len=SEQ), prefetch=prefetch)
    return build_data(cfg, char_tokenizer(), dp_rank=0, dp_size=1, micro_batch_size=1, global_batch_size=4,
                      stage=stage)


def _record_mask_builds(monkeypatch) -> list[str]:
    """The names of the threads that build flex block masks, in order."""
    threads = []
    real = document_attention.plan

    def recorded(seg, flex):
        if flex:
            threads.append(threading.current_thread().name)
        return real(seg, flex=flex)
    monkeypatch.setattr(document_attention, "plan", recorded)
    return threads


def _planner(flex: bool, cp: int = 1, cp_rank: int = 0) -> MaskPlanner:
    return MaskPlanner(torch.device("cpu"), cp, cp_rank, flex, torch.float32)


def _no_mask_in_step(real):
    """`plan` for a step that must plan no mask; the data thread, building later batches meanwhile, may."""
    def plan(segment_ids, flex):
        in_step = threading.current_thread() is threading.main_thread()
        assert not (in_step and segment_ids is not None), "a mask was planned in the step"
        return real(segment_ids, flex=flex)
    return plan


def _loss(chunks, ps, mbs) -> float:
    return forward_backward(chunks, ps, mbs, schedule="1f1b", num_tokens=10_000, forward_only=True)


def test_staged_block_masks_are_built_in_the_data_thread_and_give_the_dense_masks_loss(tmp_path, monkeypatch):
    built_on = _record_mask_builds(monkeypatch)
    ps = make_ps(world=1)
    chunks = load_chunks(HFCheckpoint(save_tiny("llama3", tmp_path / "m", num_attention_heads=4)), ps)
    exact = [copy.deepcopy(c).double() for c in chunks]
    stager = Stager(_planner(flex=True))
    ahead, plain = _data(tmp_path, prefetch=2, stage=stager), _data(tmp_path, prefetch=0)
    packed = single = 0
    for _ in range(3):
        raw = next(plain).microbatches
        mbs = stager.take(next(ahead))
        for mb, ref in zip(mbs, raw):
            assert mb.segment_ids is None and torch.equal(mb.input_ids, ref.input_ids)
            if single_document(ref.segment_ids):  # plain causal: no ids, no mask
                single += 1
                assert mb.docs is None
                continue
            packed += 1
            b, s = ref.shape
            elements = create_mask(mb.docs.block.mask_mod, b, None, s, s)
            assert torch.equal(elements, document_causal_mask(ref.segment_ids))
        with monkeypatch.context() as step:  # the step plans no mask: every one came with its micro-batch
            step.setattr(document_attention, "plan", _no_mask_in_step(document_attention.plan))
            got = _loss(chunks, ps, mbs)
        want, truth = _loss(chunks, ps, raw), _loss(exact, ps, raw)  # the dense mask, fp32 and float64
        # flex and SDPA sum the same softmax-weighted values in other blockings: each within rounding of the
        # float64 loss, as far as the dense fp32 one is (x ROUNDING_FACTOR, twice: two fp32 runs) + 4 eps.
        bound = 2 * (ROUNDING_FACTOR * abs(want - truth) + 4 * FP32_EPS * abs(truth))
        within(abs(got - want), bound, "staged flex masks vs dense masks, loss")
    ahead.close()
    assert packed and single  # the stream has both kinds of micro-batch
    assert built_on and set(built_on) == {"hfmeg-data-prefetch"}  # and none in the step (MainThread)


def test_staging_is_idempotent_and_leaves_dense_masks_to_the_chunk():
    seg = torch.tensor([[1] * 100 + [2] * 100 + [0] * 56])
    zeros = torch.zeros(1, SEQ, dtype=torch.long)
    mb = MicroBatch(input_ids=zeros, labels=zeros, segment_ids=seg)
    dense = stage_microbatch(mb, _planner(flex=False))
    assert dense.docs is None and dense.segment_ids is seg  # built by the chunk, at use
    staged = stage_microbatch(mb, _planner(flex=True))
    again = stage_microbatch(staged, _planner(flex=True))
    assert again.docs is staged.docs and again.segment_ids is None
    one_doc = stage_microbatch(replace(mb, segment_ids=torch.ones(1, SEQ, dtype=torch.long)), _planner(flex=True))
    assert one_doc.segment_ids is None and one_doc.docs is None  # plain causal attention


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_masks_read_the_keys_documents_from_the_rows_with_no_collective(cp):
    """Each CP rank's mask, staged (flex) and at use (dense), from the micro-batch `MicroBatch.shard` cuts: the
    keys' ids it reads from the whole rows are what an all-gather of every rank's ids would give, and the mask
    is the document-causal one of its queries over the gathered keys. No process group exists here."""
    lengths = ((300, 77, 129, 400, 118), (1024,))  # documents crossing the 128-token blocks and the CP chunks
    seg = torch.cat([torch.repeat_interleave(torch.arange(1, len(n) + 1), torch.tensor(n)).unsqueeze(0)
                     for n in lengths])
    s = seg.shape[1]
    zeros = torch.zeros(2, s, dtype=torch.long)
    whole = MicroBatch(input_ids=zeros, labels=zeros, segment_ids=seg)
    shards = [whole.shard(r, cp) for r in range(cp)]  # reads no group
    gathered = torch.cat([m.segment_ids for m in shards], dim=1)  # what the CP all-gather returned
    kv_index = gathered_index(s, cp)
    for r, mb in enumerate(shards):
        assert torch.equal(mb.row_segment_ids, seg)
        q_index = token_index(s, cp, r)
        want = split_causal_mask(q_index, kv_index, mb.segment_ids, gathered)
        staged = stage_microbatch(mb, _planner(flex=True, cp=cp, cp_rank=r))
        # the ids went into the mask
        assert staged.segment_ids is None and staged.row_segment_ids is None and staged.position_ids is not None
        assert torch.equal(create_mask(staged.docs.block.mask_mod, 2, None, s // cp, s), want)
        dense = _planner(flex=False, cp=cp, cp_rank=r).mask(mb.segment_ids, s // cp, mb.row_segment_ids)
        assert torch.equal(dense.dense == 0, want)  # additive: 0 where allowed, -inf elsewhere
        with pytest.raises(LayoutError, match="row_segment_ids"):
            _planner(flex=False, cp=cp, cp_rank=r).mask(mb.segment_ids, s // cp)


def test_the_trainer_data_is_staged_by_its_model(tmp_path):
    ps = make_ps(world=1)
    chunk = load_chunks(HFCheckpoint(save_tiny("llama3", tmp_path / "m")), ps)[0]
    stager = chunk.stager()
    assert stager.planner == MaskPlanner(ps.device, ps.cp, ps.cp_rank, False, torch.float32)  # CPU: dense masks
    batch = next(_data(tmp_path, prefetch=0, stage=stager))
    assert isinstance(batch, staging.StagedBatch) and batch.ready is None  # CPU: no stream to wait on


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staging_on_a_side_stream_trains_as_staging_in_the_step(tmp_path, monkeypatch):
    """The trainer's path on CUDA: the stager's copies and block masks on its side stream in the data thread,
    the step's stream waiting on its event; loss and gradients as when the executor stages in the step.
    The same masks and kernels run: the loss is bit-equal; the gradients only differ where a kernel sums with
    atomics in a varying order (SDPA's memory-efficient backward on one-document rows), each within fp32
    rounding of the same sums: the fp32 tolerance of the flex-vs-dense GPU test (test_attention.py)."""
    built_on = _record_mask_builds(monkeypatch)
    ps = make_ps(world=1, device="cuda")
    # heads of 16 (flex's smallest): head_dim is set with the head count, not derived after the config is built
    chunks = load_chunks(HFCheckpoint(save_tiny("llama3", tmp_path / "m", num_attention_heads=4, head_dim=16)), ps)
    stager = chunks[0].stager()
    assert stager.planner.flex and stager.stream is not None
    ahead, plain = _data(tmp_path, prefetch=2, stage=stager), _data(tmp_path, prefetch=0)
    for _ in range(3):
        results = []
        for mbs in (stager.take(next(ahead)), next(plain).microbatches):
            for c in chunks:
                c.zero_grad(set_to_none=True)
            loss = forward_backward(chunks, ps, mbs, schedule="1f1b", num_tokens=10_000)
            results.append((loss, [p.grad.clone() for c in chunks for p in c.parameters()]))
        (l1, g1), (l2, g2) = results
        assert l1 == l2
        for a, b in zip(g1, g2):
            assert_close(a, b, rtol=2e-4, atol=2e-4)
    ahead.close()
    assert "hfmeg-data-prefetch" in built_on
