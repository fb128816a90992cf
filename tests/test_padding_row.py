"""The embedding row of `pad_token_id` never trains, as in transformers (every family but GPT-2 builds its
`nn.Embedding` with `padding_idx=pad_token_id`): its gradient is zero, fused into the main grad (the DP
wrapper's sink) or through autograd, at TP 1 and at TP 2 with the row on the second rank; every other row's
gradient is transformers'. A tied LM head's own gradient still reaches that row, as in transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bounds import rounding_bound, within
from helpers import gather_tp, make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.families import model_config_from_hf
from hfmeg.parallel.data_parallel import DataParallel
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.stored_names import stored_tensors
from tiny_models import save_tiny

PAD = 250  # vocabulary 300, padded to 2 x 192 rows at TP 2: the row lies on the second rank
IDS = torch.tensor([[5, PAD, 17, PAD, 40, 41, PAD, 3], [PAD, 9, 9, 120, PAD, 299, 1, 2]])


def _hf_embedding_grad(folder, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dtype)
    # transformers shifts the labels and means over the IDS[:, 1:] tokens; hfmeg's chunk sums per-token losses
    (model(input_ids=IDS, labels=IDS).loss * IDS[:, 1:].numel()).backward()
    return model.get_input_embeddings().weight.grad


def _embedding_grad(folder, tp, fuse):
    ps = make_ps(tp=tp)
    chunk = load_chunks(HFCheckpoint(folder), ps)[0]
    labels = torch.cat([IDS[:, 1:], torch.full_like(IDS[:, :1], -100)], dim=1)
    wrapper = DataParallel([chunk], ps, "ddp", bucket_size=2**20, fuse_wgrad=fuse)
    chunk(IDS, labels=labels).sum().backward()
    wrapper.finish_grad_sync()
    grads = stored_tensors(chunk, lambda p: p.main_grad)
    (rule,) = [r for r in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process)
               if r.local == "embed.weight"]
    return next(iter(to_hf(rule, gather_tp(grads[rule.local], ps), chunk.cfg).values()))


@pytest.mark.parametrize("tied", [False, True])
def test_the_padding_row_gets_no_embedding_gradient(tmp_path, tied):
    folder = save_tiny("llama_tied" if tied else "llama3", tmp_path / "m", pad_token_id=PAD)
    assert model_config_from_hf(AutoConfig.from_pretrained(folder)).pad_token_id == PAD
    ref = _hf_embedding_grad(folder)
    # Two implementations' fp32 orders of the same sums: each within rounding of transformers' float64 run.
    bound = rounding_bound(ref, _hf_embedding_grad(folder, torch.float64)) / ref.abs().max().item()
    if not tied:
        assert ref[PAD].abs().max() == 0 and IDS.eq(PAD).sum() == 5  # the row is read, and transformers trains it not
    for tp in (1, 2):
        for fuse in (True, False):
            got = spawn(_embedding_grad, tp, folder, tp, fuse)[0]
            row = (tied, tp, fuse)
            within(((got - ref).abs().max() / ref.abs().max()).item(), bound, "embedding grad", row)
            if not tied:
                assert got[PAD].abs().max() == 0, row
