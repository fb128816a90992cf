"""Bytes of memory traffic per parameter in one optimizer step, by kernel, hfmeg against plain torch.

Every ATen call inside the step is traced (`TorchDispatchMode`) and charged the traffic of a
kernel that reads each input once and writes each output once: an argument the op's schema
marks as written counts as written, and also as read unless the op only overwrites it
(`copy_`'s destination, `zero_`, `fill_`, `out=`). Divided by the parameters the rank's
optimizer owns, this is the B/param/step of the step's passes: the gradient norm, the clip,
AdamW, the bf16 publish, zeroing the gradient buffers. It counts passes, not time: on a GPU
each pass is bandwidth-bound, so fewer bytes is a shorter step, but a CPU's timings here would
say little.

Rows, the same model and a gradient from the same backward, all with clipping active
(`--clip` below the gradient norm):
- `hfmeg fused` (the default `optim.impl`): the clip coefficient and the loss scale travel as the
  fused AdamW's `grad_scale`;
- `hfmeg foreach`: torch's foreach AdamW, which has no such input: the gradients are multiplied first;
- `torch` (anchor): a plain loop on fp32 parameters, `clip_grad_norm_` + fused `AdamW` + `zero_grad`
  (no master copy, so nothing to publish).

One rank (DP 1), so no collective runs in the step. At DP d every pass but one is over the
rank's 1/d shard, the same B per owned parameter; zeroing the gradient buffer covers the whole
buffer (the backward writes all of it), 4·d B per owned parameter.

    .venv/bin/python tools/bench_optimizer_bytes.py            # a 4-layer 512-wide LLaMA
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist
from bench_args import at_least
from bench_optimizer import _adamw, make_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.optim import DistributedOptimizer, OptimizerConfig
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.state import ParallelConfig, ParallelState

OVERWRITES = {"copy_", "zero_", "fill_", "_foreach_zero_", "_foreach_copy_"}  # written arguments not read


def _nbytes(x) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(x) if isinstance(t, torch.Tensor))


class TrafficMeter(TorchDispatchMode):
    """Bytes read and written per ATen op (its overload packet's name) while active."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        schema = func._schema
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view: no data moves
        moved = 0
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
            written = arg.alias_info is not None and arg.alias_info.is_write
            read = not written or (name not in OVERWRITES and not arg.is_out)
            moved += _nbytes(value) * (int(written) + int(read))
        if not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            moved += _nbytes(out)  # a functional op writes its outputs
        self.bytes[name] += moved
        return out


def _gradients(chunk, a, ps) -> None:
    ids = torch.randint(0, a.vocab, (1, a.seq), generator=torch.Generator().manual_seed(ps.rank))
    (chunk(ids, labels=ids).sum() / ids.numel()).backward()


def _measure(step, chunk, a, ps) -> dict[str, int]:
    """The traffic of the second `step()` (the first creates the AdamW state), each after a backward."""
    _gradients(chunk, a, ps)
    step()
    _gradients(chunk, a, ps)
    with TrafficMeter() as meter:
        step()
    return dict(meter.bytes)


def _worker(folder: str, a) -> dict:
    ps = ParallelState(ParallelConfig(), dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    rows = {}
    for impl in ("fused", "foreach"):
        # bf16 parameters with fp32 master weights and main grads, as hfmeg trains
        chunk = load_chunks(HFCheckpoint(folder), ps, dtype=torch.bfloat16)[0]
        opt = DistributedOptimizer([chunk], ps, OptimizerConfig(grad_clip=a.clip, impl=impl, bucket_size=a.bucket_size))
        opt.set_last_microbatch(0, True)

        def step():
            opt.step()
            opt.wait_params()
        owned = sum(b.shard_size for b in opt.buckets)
        rows[f"hfmeg {impl}"] = (_measure(step, chunk, a, ps), owned)
    chunk = load_chunks(HFCheckpoint(folder), ps, dtype=torch.float32)[0]
    adamw = _adamw(chunk, OptimizerConfig(impl="fused"))

    def plain():
        torch.nn.utils.clip_grad_norm_(chunk.parameters(), a.clip)
        adamw.step()
        adamw.zero_grad(set_to_none=False)
    rows["torch"] = (_measure(plain, chunk, a, ps), sum(p.numel() for p in chunk.parameters()))
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=at_least(64), default=512)
    p.add_argument("--layers", type=at_least(1), default=4)
    p.add_argument("--vocab", type=at_least(2), default=32000)
    p.add_argument("--seq", type=at_least(2), default=128)
    p.add_argument("--bucket-size", type=at_least(1), default=2**22, dest="bucket_size")
    p.add_argument("--clip", type=float, default=1e-3, help="max grad norm, below the norm so clipping runs")
    a = p.parse_args(argv)
    a.ffn = None
    with tempfile.TemporaryDirectory() as tmp:
        params = make_model(Path(tmp), a)
        rows = spawn(_worker, 1, tmp, a, timeout_s=1800)[0]
    result = {"params": params, "rows": {}}
    anchor = None
    for name, (traffic, owned) in rows.items():
        per = {op: b / owned for op, b in sorted(traffic.items(), key=lambda kv: -kv[1])}
        total = sum(per.values())
        anchor = total if name == "torch" else anchor
        result["rows"][name] = {"bytes_per_param": total, "owned_params": owned, "by_op": per}
    for name, row in result["rows"].items():
        row["vs_torch"] = row["bytes_per_param"] / anchor
        ops = "  ".join(f"{op} {b:.1f}" for op, b in row["by_op"].items() if b >= 0.05)
        print(f"{name:<14} {row['bytes_per_param']:5.1f} B/param/step ({row['vs_torch']:.2f}x torch)  {ops}")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
