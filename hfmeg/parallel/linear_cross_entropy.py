"""LM head + vocab-parallel cross-entropy, chunked over tokens.

The plain path materialises `[tokens, V/tp]` logits in the model dtype and again in
fp32 for the softmax; at seq 4096 x vocab 32000 that is GBs per micro-batch. Here
the tokens are processed `chunk_tokens` at a time: the forward keeps only the
per-token log-sum-exp, and the backward recomputes each chunk's logits to form
`softmax - onehot` and accumulates the input and weight gradients. Peak extra
memory is one chunk's fp32 logits; the cost is one more LM-head matmul.

Per chunk, across TP ranks (each holding a contiguous vocabulary range):
    m   = max over all ranks of the logits          (all-reduce MAX)
    lse = m + log(sum over all ranks exp(z - m))     (all-reduce SUM)
    z_t = the target's logit, from the rank that owns it (all-reduce SUM)
    loss = lse - z_t
Asked for it (GRPO's `entropy` metric), the same pass also gives each token's entropy of the softmax, with no
gradient: H = lse - E_p[z] = log s - (sum exp(z - m)(z - m)) / s, s = sum exp(z - m), a third row of the same
all-reduce (measured from m, so no cancellation of the large m against lse).
Columns past the real vocabulary (padding) are masked to -inf. With final logit
soft-capping (Gemma) the logits are z' = cap·tanh(z/cap), capped before the padding
mask, and the backward multiplies softmax - onehot by dz'/dz = 1 - tanh²(z/cap).

Low-precision (bf16/fp16) weights: the softmax gradient is formed in fp32, then
rounded once to the weight dtype so that both backward GEMMs run on the tensor
cores with fp32 accumulation (no fp32 copy of the head weight). The weight
gradient's products are written in fp32 (`wgrad.add_product`), in row blocks so the
CPU's fp32 temporaries stay small next to the `[V/tp, h]` gradient. Where the DP
wrapper keeps an fp32 main gradient they go straight into it (gradient-accumulation
fusion, wgrad.py: no gradient is returned for the weight, and the head's gradient is
never rounded to bf16 on its way there); otherwise into an fp32 buffer returned in
the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .state import ParallelState
from .wgrad import add_product, sink_of

CE_CHUNK_TOKENS = 4096  # tokens whose logits exist at once, unless a caller says otherwise


def _chunk_logits(x: torch.Tensor, w: torch.Tensor, vocab_start: int, vocab_size: int,
                  softcap: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's fp32 logits (soft-capped: `cap * tanh(z / cap)`), padding columns -inf; with `softcap`, also
    tanh(z / cap), whose 1 - tanh² is the cap's derivative (finite on the padding columns, where the softmax
    gradient is 0)."""
    z = (x @ w.t()).float()
    t = None
    if softcap is not None:  # capped before the padding mask: tanh would turn -inf into -cap
        t = torch.tanh(z / softcap)
        z = t * softcap
    if vocab_start + z.shape[-1] > vocab_size:
        cols = torch.arange(vocab_start, vocab_start + z.shape[-1], device=z.device)
        z = z.masked_fill(cols >= vocab_size, float("-inf"))
    return z, t


def _add_rows(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: int = 4096) -> None:
    """`acc += a @ b` in fp32, `rows` output rows at a time (see the module docstring)."""
    for lo in range(0, acc.shape[0], rows):
        r = slice(lo, lo + rows)
        add_product(acc[r], a[r], b)


def _local_target(target: torch.Tensor, vocab_start: int, n_local: int):
    local = target - vocab_start
    owned = (local >= 0) & (local < n_local)
    return local.masked_fill(~owned, 0), owned


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, target, ps, vocab_size, chunk_tokens, sink, softcap, with_entropy):
        n_local = w.shape[0]
        vocab_start = ps.tp_rank * n_local
        tp = ps.tp > 1
        lse = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        z_t = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
        for lo in range(0, x.shape[0], chunk_tokens):
            sl = slice(lo, lo + chunk_tokens)
            z, _ = _chunk_logits(x[sl], w, vocab_start, vocab_size, softcap)
            m = z.max(dim=-1).values
            if tp:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.tp_group)
            local, owned = _local_target(target[sl], vocab_start, n_local)
            picked = torch.where(owned, z.gather(-1, local[:, None]).squeeze(-1), 0.0)
            shifted = z - m[:, None]
            e = shifted.exp()
            rows = [e.sum(-1), picked]
            if with_entropy:  # padding columns: exp(-inf) = 0 times a 0 in place of their -inf
                rows.append((e * shifted.nan_to_num(neginf=0.0)).sum(-1))
            sums = torch.stack(rows)
            if tp:
                dist.all_reduce(sums, group=ps.tp_group)
            lse[sl] = m + sums[0].log()
            z_t[sl] = sums[1]
            if with_entropy:
                entropy[sl] = sums[0].log() - sums[2] / sums[0]
        ctx.save_for_backward(x, w, target, lse)
        ctx.ps, ctx.vocab_size, ctx.chunk_tokens, ctx.sink, ctx.softcap = ps, vocab_size, chunk_tokens, sink, softcap
        ctx.mark_non_differentiable(entropy)
        return lse - z_t, entropy

    @staticmethod
    def backward(ctx, g, _):
        x, w, target, lse = ctx.saved_tensors
        ps = ctx.ps
        n_local = w.shape[0]
        vocab_start = ps.tp_rank * n_local
        low = w.dtype != torch.float32
        sink = ctx.sink
        grad_x = torch.empty_like(x)
        # a frozen head (LoRA, QLoRA) has no weight gradient: none is formed (an fp32 [V/tp, h] buffer and its
        # rounded copy, 0.8 GB at a 7B's vocabulary, were a LoRA step's largest temporary)
        wants_w = ctx.needs_input_grad[1]
        grad_w = sink if sink is not None or not wants_w else torch.zeros(w.shape, dtype=torch.float32,
                                                                           device=w.device)
        for lo in range(0, x.shape[0], ctx.chunk_tokens):
            sl = slice(lo, lo + ctx.chunk_tokens)
            z, t = _chunk_logits(x[sl], w, vocab_start, ctx.vocab_size, ctx.softcap)
            d = (z - lse[sl, None]).exp_()  # softmax
            local, owned = _local_target(target[sl], vocab_start, n_local)
            d.scatter_add_(-1, local[:, None], -owned.to(d.dtype)[:, None])
            d.mul_(g[sl, None])
            if t is not None:  # through the cap: d/dz cap * tanh(z / cap) = 1 - tanh²
                d.mul_(1 - t * t)
            if low:
                d = d.to(w.dtype)
                grad_x[sl] = d @ w
            else:
                grad_x[sl] = (d @ w.float()).to(x.dtype)
            if wants_w:
                _add_rows(grad_w, d.t(), x[sl])
        # Each TP rank holds a vocabulary slice, so its grad_x is partial; the caller's
        # copy-to-TP / sequence-gather backward sums it over TP.
        if sink is not None or not wants_w:
            return grad_x, None, None, None, None, None, None, None, None
        return grad_x, grad_w.to(w.dtype), None, None, None, None, None, None, None


def linear_cross_entropy(
    x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ps: ParallelState, vocab_size: int,
    chunk_tokens: int = CE_CHUNK_TOKENS, softcap: float | None = None, entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp32 loss of `x @ weight.T` (soft-capped at `softcap` where given) against `target` (-100
    ignored); with `entropy`, `(loss, entropy)`, the second each token's softmax entropy (no gradient).

    `x` is `[..., h]` (already copied/gathered for TP), `weight` this rank's
    `[V_pad/tp, h]` slice; the outputs have `x`'s leading shape, 0 where the target is ignored. Where the weight
    has a sink (wgrad.py) its gradient goes there.
    """
    lead = x.shape[:-1]
    flat_t = target.reshape(-1)
    ignore = flat_t < 0
    loss, h = _LinearCrossEntropy.apply(
        x.reshape(-1, x.shape[-1]), weight, flat_t.masked_fill(ignore, 0), ps, vocab_size, chunk_tokens,
        sink_of(weight), softcap, entropy,
    )
    loss = loss.masked_fill(ignore, 0.0).reshape(lead)
    return (loss, h.masked_fill(ignore, 0.0).reshape(lead)) if entropy else loss
