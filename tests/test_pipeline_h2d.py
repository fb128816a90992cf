"""Micro-batches reach the device without host syncs: pinned, non-blocking copies; the loss can stay on device."""

from __future__ import annotations

import pytest
import torch

from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.data import DataConfig, SourceConfig, build_data
from hfmeg.parallel.pipeline import forward_backward
from test_data import char_tokenizer
from test_data_batches import OWN
from tiny_models import save_tiny


def _step_loss(device: torch.device, tmp_path, monkeypatch) -> tuple[float, torch.Tensor, int]:
    """(synced loss, device loss, pin_memory calls) of one packed batch on `device`."""
    ps = make_ps(world=1, device=device)
    chunk = load_chunks(HFCheckpoint(save_tiny("llama3", tmp_path / "m")), ps)[0]
    cfg = DataConfig(sources=[SourceConfig(str(OWN / "sft_sample.jsonl"))], seq_len=128, prefetch=0)
    batch = next(build_data(cfg, char_tokenizer(), dp_rank=0, dp_size=1, micro_batch_size=2, global_batch_size=4))
    pins = []
    real = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: pins.append(1) or real(t, *a))
    kw = dict(schedule="1f1b", num_tokens=batch.num_tokens, forward_only=True)
    synced = forward_backward([chunk], ps, batch.microbatches, **kw)
    on_device = forward_backward([chunk], ps, batch.microbatches, sync_loss=False, **kw)
    return synced, on_device, len(pins)


def test_cpu_loss_on_device_equals_the_synced_loss(tmp_path, monkeypatch):
    synced, on_device, pins = _step_loss(torch.device("cpu"), tmp_path, monkeypatch)
    assert isinstance(synced, float) and on_device.dim() == 0 and on_device.item() == synced
    assert pins == 0  # CPU: nothing is pinned


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_micro_batches_go_through_pinned_memory(tmp_path, monkeypatch):
    synced, on_device, pins = _step_loss(torch.device("cuda:0"), tmp_path, monkeypatch)
    assert on_device.is_cuda and on_device.item() == synced
    assert pins == 2 * 2 * 4  # two calls x two micro-batches x four keys
