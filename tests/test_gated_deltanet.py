"""Gated DeltaNet (Qwen3.5's linear attention) against transformers' own torch implementation, on packed rows.

transformers' torch path (`torch_chunk_gated_delta_rule`, `causal_conv1d_fn`) takes no document boundaries, so
each document of a packed row runs through it alone; hfmeg runs the packed rows at once, its state and
convolution window reset at each document start. Rows of 100 tokens with documents crossing the 64-token
chunks of both implementations, forward and backward (the input's gradient and every parameter's, mapped to
HF's tensors by the conversion rules).

The bound: both compute the same function in fp32 (unit roundoff u = 2^-24) and differ only in the order of
their sums. A result's rounding error is at most about n u times the magnitude of its terms, n the length of the
longest chain of dependent roundings: a chunk (64, the triangular solve and the intra-chunk products), a head's
dims (8), the convolution taps (4) and one state step per chunk (2 chunks). Each implementation carries its own,
so the two differ by at most 2 n u relative to the largest output (or gradient); the backward pass walks the
same chains in reverse, doubling n, and a parameter's gradient is moreover a sum over the rows' tokens (b s more
roundings: A_log's and dt_bias's, one number per head, sum 200 terms each).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from bounds import within
from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import to_hf
from hfmeg.families import spec_of
from hfmeg.models.document_attention import DocumentMask
from hfmeg.models.gated_delta_rule import CHUNK, document_runs
from tiny_models import save_tiny

U = 2.0 ** -24
ROW = 100
DOCS = [[37, 50, 13], [70, 30]]  # document lengths per row: starts mid-chunk, and documents across chunks 0 and 1


def _segments() -> torch.Tensor:
    return torch.tensor([[i + 1 for i, n in enumerate(row) for _ in range(n)] for row in DOCS])


def test_gated_deltanet_matches_transformers_per_document(tmp_path):
    folder = save_tiny("qwen3_5", tmp_path / "qwen3_5")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).model.layers[0].linear_attn
    chunk = load_chunks(HFCheckpoint(folder), make_ps())[0]
    ours = chunk.layers["0"].attn
    cfg, la = chunk.cfg, chunk.cfg.linear_attention
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(DOCS), ROW, cfg.hidden_size, generator=g)
    probe = torch.randn(len(DOCS), ROW, cfg.hidden_size, generator=g)  # the loss: <output, probe>

    x_ours = x.clone().requires_grad_()
    out = ours(x_ours.transpose(0, 1), None, DocumentMask(documents=document_runs(_segments()))).transpose(0, 1)
    (out * probe).sum().backward()

    x_ref = x.clone().requires_grad_()
    ref = torch.empty_like(out)
    for r, row in enumerate(DOCS):
        start = 0
        for n in row:  # each document alone, from a fresh state
            ref[r, start:start + n] = hf(x_ref[r:r + 1, start:start + n])[0]
            start += n
    (ref * probe).sum().backward()

    n = CHUNK + la.key_dim + la.conv_kernel + -(-ROW // CHUNK)
    within(((out - ref).abs().max() / ref.abs().max()).item(), 2 * n * U, "forward relative")
    within(((x_ours.grad - x_ref.grad).abs().max() / x_ref.grad.abs().max()).item(), 4 * n * U, "input grad relative")
    params = dict(ours.named_parameters())
    hf_params = dict(hf.named_parameters())
    compared = set()
    for rule in spec_of(cfg).layer_rules(cfg, 0, ()):
        name = rule.local.removeprefix("layers.0.attn.")
        if name not in params:
            continue
        for hf_name, grad in to_hf(rule, [params[name].grad], cfg).items():
            expected = hf_params[hf_name.removeprefix("model.layers.0.linear_attn.")].grad
            within((grad - expected).abs().max() / expected.abs().max(), 4 * (n + x.numel() // cfg.hidden_size) * U,
                   f"{hf_name} grad relative")
            compared.add(hf_name)
    assert len(compared) == len(hf_params), (sorted(compared), sorted(hf_params))


def test_one_document_rows_need_no_resets(tmp_path):
    """A row of one document: the packed path (one run) and the unpacked one (no documents) agree exactly."""
    folder = save_tiny("qwen3_5", tmp_path / "qwen3_5")
    ours = load_chunks(HFCheckpoint(folder), make_ps())[0].layers["0"].attn
    x = torch.randn(ROW, 2, ours.in_proj.weight.shape[1], generator=torch.Generator().manual_seed(1))
    one = DocumentMask(documents=document_runs(torch.ones(2, ROW, dtype=torch.long)))
    assert torch.equal(ours(x, None, one), ours(x, None, None))
