"""The bf16 CUDA path: parity with transformers, Inductor kernels vs eager, the MFU bench, and a MoE layer
that never waits for the device.

Skipped without CUDA. bf16 tolerances are not guessed: both bf16 implementations are
measured against an fp32 transformers reference on the same weights, and hfmeg's
error must be of the same size as transformers' own bf16 error.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import make_ps, moe_layer
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.rules import chunk_rules, to_hf
from hfmeg.checkpoint.tensor_source import TensorSource
from hfmeg.models.kernels import Kernels
from hfmeg.models.random_init import random_hf_model
from hfmeg.parallel.state import BACKEND_ENV
from hfmeg.parallel.stored_names import stored_tensors
from tiny_models import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_mfu.py"
SHAPES = dict(hidden_size=256, intermediate_size=688, num_attention_heads=8, num_key_value_heads=4,
              num_hidden_layers=2, vocab_size=1000, max_position_embeddings=256)
# The families added since LLaMA, each at its tiny test shapes (tests/tiny_models.py) with heads of 16 wide where
# the family allows it, so that rows take flex_attention's compiled kernel (windows, soft-capping, sinks) as
# training does on a GPU; DeepSeek-V3's MLA heads (q/k 12, v 6) take the dense path. Router logits are not
# output, so both sides' losses are the cross-entropy alone.
FAMILIES = {
    "qwen3": {}, "phi3": {}, "olmo3": {}, "qwen3_5": {},
    "gemma2": dict(head_dim=16), "gemma3": dict(head_dim=16), "gemma4": dict(head_dim=16, global_head_dim=16),
    "gpt_oss": dict(head_dim=16, output_router_logits=False), "deepseek_v3": dict(output_router_logits=False),
}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()


def _hf_run(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach().float(), {n: p.grad for n, p in model.named_parameters()}


def _hfmeg_run(chunk, ids):
    """The loss and the gradient of every HF tensor hfmeg trains (a stacked expert tensor as one, like HF's)."""
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    loss = chunk(ids, labels=labels).sum() / (labels != -100).sum()
    loss.backward()
    stored = stored_tensors(chunk, lambda p: p.grad)
    grads, experts = {}, {}
    for rule in chunk_rules(chunk.cfg, chunk.layer_ids, chunk.pre_process, chunk.post_process, chunk.experts):
        if stored[rule.local] is None:  # a frozen tensor (DeepSeek-V3's routing correction bias)
            continue
        for name, g in to_hf(rule, [stored[rule.local]], chunk.cfg).items():
            if rule.expert is None:
                grads[name] = g
            else:
                experts.setdefault(name, {})[rule.expert] = g
    grads.update({name: torch.stack([e[i] for i in sorted(e)]) for name, e in experts.items()})
    return loss.detach().float(), grads


def check_bf16_parity(device: torch.device, compile_backend: str | None, kind: str = "llama3") -> None:
    """hfmeg bf16 loss and every gradient vs transformers bf16, both judged against fp32 transformers."""
    hf_cfg = tiny_config(kind, **(SHAPES if kind == "llama3" else FAMILIES[kind]))
    ref = random_hf_model(hf_cfg, seed=0, dtype=torch.float32, device=device)
    hf16 = copy.deepcopy(ref).to(torch.bfloat16)
    ps = make_ps(world=1, device=device)
    ours = load_chunks(TensorSource.snapshot(ref), ps, dtype=torch.bfloat16, compile_backend=compile_backend)[0]
    ids = torch.randint(0, hf_cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0)).to(device)
    loss32, grads32 = _hf_run(ref, ids)
    loss_hf, grads_hf = _hf_run(hf16, ids)
    loss_ours, grads_ours = _hfmeg_run(ours, ids)
    assert grads_ours.keys() == {n for n, g in grads32.items() if g is not None}
    hf_err = abs(loss_hf - loss32).item()
    assert abs(loss_ours - loss32).item() <= max(3 * hf_err, 1e-2 * loss32.item()), (loss_ours, loss_hf, loss32)
    for name, g32 in grads32.items():
        if g32 is None:
            continue
        ours_err, hf_err = _rel(grads_ours[name], g32), _rel(grads_hf[name], g32)
        assert ours_err <= max(3 * hf_err, 2e-2), (name, ours_err, hf_err)


def check_kernels_match_eager(device: torch.device, backend: str) -> None:
    """Each compiled kernel, forward and backward, against the eager function on bf16 inputs."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=g).to(torch.bfloat16).requires_grad_()

    s, b, h, heads, d = 64, 2, 256, 4, 64
    angles = torch.rand(b, s, d, device=device, generator=g) * 6.28
    cases = {
        "rms_norm": lambda k, x, w: k.rms_norm(x, w, 1e-5),
        "rope": lambda k, x: k.rope(x, angles.cos().bfloat16(), angles.sin().bfloat16()),
        "swiglu": lambda k, a, u: k.swiglu(a, u),
    }
    inputs = {"rms_norm": (rand(s, b, h), rand(h)), "rope": (rand(b, heads, s, d),),
              "swiglu": (rand(s, b, 4 * h), rand(s, b, 4 * h))}
    eager, compiled = Kernels(None), Kernels(backend)
    for name, fn in cases.items():
        outs = []
        for k in (eager, compiled):
            xs = [x.detach().clone().requires_grad_() for x in inputs[name]]
            y = fn(k, *xs)
            y.float().square().sum().backward()
            outs.append((y.detach(), [x.grad for x in xs]))
        (y0, g0), (y1, g1) = outs
        assert y1.dtype == y0.dtype == torch.bfloat16
        torch.testing.assert_close(y1, y0, rtol=2e-2, atol=2e-2, msg=name)
        for a, c in zip(g1, g0):
            assert _rel(a, c) < 2e-2, name


def test_bf16_hfmeg_matches_transformers_on_cuda():
    check_bf16_parity(torch.device("cuda"), compile_backend=None)


@pytest.mark.parametrize("kind", sorted(FAMILIES))
def test_bf16_family_matches_transformers_on_cuda(kind):
    """Each newer family in bf16 with the Inductor kernels, as training runs it on a GPU."""
    check_bf16_parity(torch.device("cuda"), compile_backend="inductor", kind=kind)


def test_bf16_hfmeg_with_inductor_kernels_matches_transformers_on_cuda():
    check_bf16_parity(torch.device("cuda"), compile_backend="inductor")


def test_inductor_kernels_match_eager_on_cuda():
    check_kernels_match_eager(torch.device("cuda"), "inductor")


def test_bench_mfu_small_run_on_cuda():
    """The bench's CUDA path end to end at a small size: bf16, Inductor, peak memory, MFU."""
    cmd = [sys.executable, str(TOOL), "--layers", "2", "--hidden", "512", "--ffn", "1376", "--heads", "8",
           "--vocab", "2000", "--seq", "512", "--micro-batch-size", "2", "--grad-accum", "2", "--steps", "2",
           "--warmup", "1", "--peak-tflops", "100"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["device"] == torch.cuda.get_device_name() and r["dtype"] == "bfloat16"
    assert r["hfmeg_tokens"] == r["hf_tokens"]
    for side in ("hfmeg", "hf"):
        assert isinstance(r[f"{side}_peak_mem_bytes"], int) and r[f"{side}_peak_mem_bytes"] > 0
        assert 0 < r[f"{side}_mfu"] < 1
    # Same weights and ids; bf16 forward passes agree to bf16 accuracy before any update.
    assert abs(r["hfmeg_losses"][0] - r["hf_losses"][0]) < 2e-2 * r["hf_losses"][0]


NCCL_WORLD_OF_ONE = """
import torch, torch.distributed as dist
from hfmeg.optim.clip import global_norm
from hfmeg.parallel.state import ParallelConfig, ParallelState
ps = ParallelState.from_env(ParallelConfig())
assert ps.device == torch.device("cuda", 0) and dist.get_backend() == "nccl", (ps.device, dist.get_backend())
assert torch.cuda.current_device() == 0
assert global_norm([], None, True, ps.device) == 0.0  # a rank with no counted gradients in an NCCL all-reduce
dist.destroy_process_group()
"""


def test_nccl_binds_cuda_and_reduces_an_empty_gradient_norm():
    """`from_env` with nccl on cuda:0 (a fresh process: pytest's own stays gloo), and clip.py's collective on it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", NCCL_WORLD_OF_ONE], env={**env, BACKEND_ENV: "nccl"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


def test_moe_layer_runs_without_a_device_sync_on_cuda():
    """A MoE micro-batch at EP 1 (routing, dispatch, grouped bf16 experts, combine; forward and backward)
    under CUDA's sync debug mode: any wait for the device raises. Sizes fit the grouped kernel (multiples of 8
    in bf16); one run first, so lazy initialisation is not what is judged."""
    layer = moe_layer(hidden=256, ffn=128).to("cuda", torch.bfloat16)
    x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    layer(x).backward(dy)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert layer.experts.fc1.grad.abs().sum() > 0
