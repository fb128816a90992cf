"""Staging (models/staging.py): a step's micro-batches on the device with their attention decided once per
micro-batch, in the data prefetch thread, so the step builds no mask.

On CPU the model attends packed rows with the dense mask (flex_attention has no backward there), so the
flex block masks are staged here by a `Stager` told to (`flex=True`) and checked forward only; the CUDA
test runs the trainer's own stager, forward and backward."""

from __future__ import annotations

import copy
import threading
from dataclasses import replace

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

import hfmeg.models.decoder as decoder
import hfmeg.models.staging as staging
from bounds import within
from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data import build_data
from hfmeg.data.packing import single_document
from hfmeg.models.document_attention import document_causal_mask
from hfmeg.models.staging import Stager
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
    """The names of the threads that build staged masks, in order."""
    threads = []
    real = staging.plan
    monkeypatch.setattr(staging, "plan", lambda seg, flex: threads.append(threading.current_thread().name)
                        or real(seg, flex=flex))
    return threads


def _no_mask(segment_ids, flex):
    assert segment_ids is None, "a mask was planned in the step"


def _loss(chunks, ps, mbs) -> float:
    return forward_backward(chunks, ps, mbs, schedule="1f1b", num_tokens=10_000, forward_only=True)


def test_staged_block_masks_are_built_in_the_data_thread_and_give_the_dense_masks_loss(tmp_path, monkeypatch):
    built_on = _record_mask_builds(monkeypatch)
    ps = make_ps(world=1)
    chunks = load_chunks(HFCheckpoint(save_tiny("llama3", tmp_path / "m", num_attention_heads=4)), ps)
    exact = [copy.deepcopy(c).double() for c in chunks]
    stager = Stager(ps.device, flex=True, cp=1)
    ahead, plain = _data(tmp_path, prefetch=2, stage=stager), _data(tmp_path, prefetch=0)
    packed = single = 0
    for _ in range(3):
        raw = next(plain).microbatches
        mbs = stager.take(next(ahead))
        for mb, ref in zip(mbs, raw):
            assert "segment_ids" not in mb and torch.equal(mb["input_ids"], ref["input_ids"])
            if single_document(ref["segment_ids"]):  # plain causal: no ids, no mask
                single += 1
                assert "docs" not in mb
                continue
            packed += 1
            b, s = ref["segment_ids"].shape
            elements = create_mask(mb["docs"].block.mask_mod, b, None, s, s)
            assert torch.equal(elements, document_causal_mask(ref["segment_ids"]))
        with monkeypatch.context() as step:  # the step plans no mask: every one came with its micro-batch
            step.setattr(decoder, "plan_document_mask", _no_mask)
            got = _loss(chunks, ps, mbs)
        want, truth = _loss(chunks, ps, raw), _loss(exact, ps, raw)  # the dense mask, fp32 and float64
        # flex and SDPA sum the same softmax-weighted values in other blockings: each within rounding of the
        # float64 loss, as far as the dense fp32 one is (x ROUNDING_FACTOR, twice: two fp32 runs) + 4 eps.
        bound = 2 * (ROUNDING_FACTOR * abs(want - truth) + 4 * FP32_EPS * abs(truth))
        within(abs(got - want), bound, "staged flex masks vs dense masks, loss")
    ahead.close()
    assert packed and single  # the stream has both kinds of micro-batch
    assert built_on and set(built_on) == {"hfmeg-data-prefetch"}  # and none in the step (MainThread)


def test_staging_is_idempotent_and_leaves_dense_masks_and_cp_to_the_chunk():
    seg = torch.tensor([[1] * 100 + [2] * 100 + [0] * 56])
    mb = {"input_ids": torch.zeros(1, SEQ, dtype=torch.long), "segment_ids": seg}
    cpu = torch.device("cpu")
    dense = staging.stage_microbatch(mb, cpu, flex=False, cp=1)
    assert "docs" not in dense and dense["segment_ids"] is seg  # built by the chunk, at use
    cp = staging.stage_microbatch(mb, cpu, flex=True, cp=2)
    assert "docs" not in cp and cp["segment_ids"] is seg  # needs the CP group's ids: a collective of the step
    staged = staging.stage_microbatch(mb, cpu, flex=True, cp=1)
    again = staging.stage_microbatch(staged, cpu, flex=True, cp=1)
    assert again["docs"] is staged["docs"] and "segment_ids" not in again
    one_doc = staging.stage_microbatch({**mb, "segment_ids": torch.ones(1, SEQ, dtype=torch.long)}, cpu, True, 1)
    assert set(one_doc) == {"input_ids"}


def test_the_trainer_data_is_staged_by_its_model(tmp_path):
    ps = make_ps(world=1)
    chunk = load_chunks(HFCheckpoint(save_tiny("llama3", tmp_path / "m")), ps)[0]
    stager = chunk.stager()
    assert (stager.device, stager.flex, stager.cp) == (ps.device, chunk.uses_flex, ps.cp)
    batch = next(_data(tmp_path, prefetch=0, stage=stager))
    assert isinstance(batch, staging.StagedBatch) and batch.ready is None  # CPU: no stream to wait on


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staging_on_a_side_stream_trains_as_staging_in_the_step(tmp_path, monkeypatch):
    """The trainer's path on CUDA: the stager's copies and block masks on its side stream in the data thread,
    the step's stream waiting on its event; loss and gradients as when the executor stages in the step."""
    built_on = _record_mask_builds(monkeypatch)
    ps = make_ps(world=1, device="cuda")
    chunks = load_chunks(HFCheckpoint(save_tiny("llama3", tmp_path / "m", num_attention_heads=4)), ps)
    stager = chunks[0].stager()
    assert stager.flex and stager.stream is not None
    ahead, plain = _data(tmp_path, prefetch=2, stage=stager), _data(tmp_path, prefetch=0)
    for _ in range(3):
        results = []
        for mbs in (stager.take(next(ahead)), next(plain).microbatches):
            for c in chunks:
                c.zero_grad(set_to_none=True)
            loss = forward_backward(chunks, ps, mbs, schedule="1f1b", num_tokens=10_000)
            results.append((loss, [p.grad.clone() for c in chunks for p in c.parameters()]))
        (l1, g1), (l2, g2) = results
        assert l1 == l2 and all(torch.equal(a, b) for a, b in zip(g1, g2))  # the same masks, the same kernels
    ahead.close()
    assert "hfmeg-data-prefetch" in built_on
