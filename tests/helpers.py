"""Helpers every kind of test shares: a rank's `ParallelState`, a random MoE layer and the stories260K asset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from tiny_models import STORIES, tiny_config

from hfmeg.families import model_config_from_hf
from hfmeg.models.kernels import Kernels
from hfmeg.models.moe import MoELayer
from hfmeg.parallel.state import ParallelConfig, ParallelState


def make_ps(tp: int = 1, pp: int = 1, vpp: int = 1, sp: bool = False, *, ep: int = 1, cp: int = 1,
            world: int | None = None, device: str | torch.device = "cpu") -> ParallelState:
    """This rank's groups for a TP x CP x PP (x VPP, x EP inside DP) layout.

    `world=None`: the rank and size of the default group (a spawned gloo world), or a world of one
    where none is initialised. `world=N`: rank 0 of N (a single-process reference inside a spawned
    rank, or a layout checked without processes)."""
    if world is None:
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    else:
        rank = 0
    return ParallelState(ParallelConfig(tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp, ep=ep, cp=cp), rank, world,
                         torch.device(device))


def gather_tp(t: torch.Tensor, ps: ParallelState) -> list[torch.Tensor]:
    """Every TP rank's `t`, in TP-rank order (what `checkpoint.rules.to_hf` rebuilds a full tensor from)."""
    if ps.tp == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(ps.tp)]
    dist.all_gather(parts, t.contiguous(), group=ps.tp_group)
    return parts


def moe_layer(ps: ParallelState | None = None, hidden: int = 32, ffn: int = 16) -> MoELayer:
    """A Qwen3-MoE layer (8 experts, top-2, TP 1) of `ps`'s EP rank (default: a world of one) with random weights,
    on CPU in fp32."""
    cfg = model_config_from_hf(tiny_config("qwen3_moe", num_experts=8, hidden_size=hidden, moe_intermediate_size=ffn))
    layer = MoELayer(cfg, ps or make_ps(), Kernels())
    torch.manual_seed(1)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    return layer


def stories_or_skip() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"{STORIES} is absent (../shared/assets not checked out beside the repo)")
    return STORIES


def float64_logits(folder, ids: torch.Tensor, **load) -> torch.Tensor:
    """transformers' logits of `ids` from the checkpoint at `folder` run in float64 (as `hfmeg verify`'s reference
    loads it: a multimodal wrapper's own class, eager attention for soft-capped scores, the experts' eager loop
    (the same arithmetic as their grouped GEMM, which has no float64 kernel); `load`: from_pretrained's),
    the truth a logit bound is derived from (`logit_bound`). Loaded in fp32 and converted, as the suite's
    float64 references are: transformers computes RoPE's angles in fp32 either way."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from hfmeg.families import text_config

    config = AutoConfig.from_pretrained(str(folder))
    text = text_config(config)
    auto = AutoModelForCausalLM if text is config else AutoModelForImageTextToText
    if getattr(text, "attn_logit_softcapping", None):
        load.setdefault("attn_implementation", "eager")
    load.setdefault("experts_implementation", "eager")
    model = auto.from_pretrained(str(folder), dtype=torch.float32, **load).double()
    with torch.no_grad():
        return model(input_ids=ids).logits


def logit_bound(folder, ids: torch.Tensor, ref32: torch.Tensor, **load) -> float:
    """How far an fp32 run's logits of `ids` may be from transformers' fp32 ones, `ref32`, by rounding alone
    (bounds.rounding_bound of ref32 against the float64 run, two fp32 runs): no fixed figure that one model's
    rounding could reach."""
    from bounds import rounding_bound

    return rounding_bound(ref32, float64_logits(folder, ids, **load)[..., :ref32.shape[-1]], runs=2)


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's safetensors files, by the name it is stored under."""
    out = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def next_token_labels(ids: torch.Tensor) -> torch.Tensor:
    """Causal-LM labels of `ids`: each position's next token, -100 (ignored) at the last."""
    return torch.cat([ids[:, 1:], torch.full((ids.shape[0], 1), -100)], dim=1)


def train_step_as_one(chunks, ps: ParallelState, ids: torch.Tensor, labels: torch.Tensor):
    """One forward + backward of `chunks` through the pipeline and the data-parallel wrapper, every DP replica of
    the world taking the same rows; (the loss as one process computes it, or None off the last stage, the wrapper).

    The replicas make a global batch of dp copies, of which this rank's share of the loss is 1/dp; the wrapper sums
    the gradients into the main grads (over DP, experts' over expert-DP, and the partial ones of the router, experts
    and q/k norms over TP) as in training."""
    from hfmeg.data.microbatch import MicroBatch
    from hfmeg.parallel.data_parallel import DataParallel
    from hfmeg.parallel.pipeline import forward_backward

    wrapper = DataParallel(chunks, ps, "ddp", bucket_size=2**20)
    loss = forward_backward(chunks, ps, [MicroBatch(input_ids=ids, labels=labels)], schedule="1f1b",
                            num_tokens=int((labels != -100).sum()) * ps.dp, grad_sync=wrapper)
    wrapper.finish_grad_sync()
    return (loss * ps.dp if loss is not None else None), wrapper


def script_rank(script: str, argv: list[str]) -> int:
    """A rank of a recipe's or tool's run in `launch.spawn` (`spawn(script_rank, n, script, argv)`): the script as
    `__main__` with `argv`, as a launcher's worker runs it; its exit code. The rank computes with the one thread
    launch.spawn gives it (hfmeg keeps an initialised world's threads), so no fresh interpreter is needed."""
    import runpy
    import sys

    sys.argv = [script, *argv]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        return e.code
    return 0
