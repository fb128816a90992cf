"""PowerSGD: low-rank compression of the data-parallel gradient sum, bucket by bucket.

The algorithm of Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression"
(NeurIPS 2019), which torch ships as a DDP-only comm hook, here on the flat buffers of
data_parallel.py, so it works with the sharded optimizer: each DP rank keeps only its
shard of the decompressed sum, as it keeps its shard of today's reduce-scatter.

What is compressed. A gradient that is a matrix M (m x n: every linear weight, the
embedding, the LM head, or this rank's TP shard of one) is compressed at rank
k = min(rank, m, n) when that pays, (m * n) / (k * (m + n)) >= min_compression_rate:
its DP sum then moves (m + n) * k elements instead of m * n. Vectors (norms, biases)
and matrices that would not pay are summed exactly, inside the same flat all-reduce
as the P factors. A stack of matrices `[B, m, n]` (the grouped MoE experts' weights,
`models/moe.py`) is B matrices compressed alike, each with its own P and Q. Other shapes
do not occur in these models; they too would be summed exactly.
A bucket with nothing to compress keeps the plain reduce-scatter.

One bucket, on DP rank i (grad_sync.py launches it when the bucket's last gradient
lands on the step's last micro-batch; gradients are SUMMED over DP):

    round 1  M_i = G_i + E_i        the local gradient plus the residual E_i that earlier
                                    steps did not transmit (error feedback)
             Q <- orthonormal(Q)    Q: n x k, identical on every rank. Same span, but well
                                    conditioned, and of full rank even after a rank-
                                    deficient step (without it, rank = min(m, n) was off
                                    by more than rounding once a gradient lost rank)
             P_i = M_i Q
             all-reduce [P_i ..., exactly summed gradients]        one flat SUM
    round 2  P = orthonormal(sum_i P_i)    Householder QR, as for Q: orthonormal columns even
                                    when P is rank deficient (a zero gradient, unused rows)
             Q_i = M_i^T P
             E_i = M_i - P Q_i^T = M_i - P P^T M_i, what the projection drops here
             all-reduce [Q_i ...]   -> Q = sum_i M_i^T P
    wait     sum = P Q^T = P P^T sum_i M_i, the DP sum projected onto span(P); only this
             rank's shard of it is computed, into the bucket's owned gradient shard.

Q is kept for the next step (warm start: one power iteration per training step tracks
the gradients' dominant subspace); it starts as a seeded normal sample, identical on
every rank. Since sum_i E_i + P Q^T = sum_i M_i, nothing is lost, only delayed: what a
projection drops is sent in later steps. With k = min(m, n), span(P) holds the whole
sum and the result is exact up to rounding.

Memory. A residual E_i is fp32 and as large as its gradient, on every rank: the naive
scheme (torch's hook) keeps one fp32 copy of every compressed gradient. Here the
main-grad buffer, fp32 and full size on every rank anyway, holds it between steps:
after the update the compressed parameters' main grads are not zeroed but set to E_i,
so the next backward accumulates G_i on top and round 1 reads M_i in place. Only the
rank's own shard, which receives the sum for the optimizer, needs E_i kept aside
(`_Plan.residual`: 1/DP of the bucket; the whole bucket in `ddp`). Add P and Q:
(m + n) * k fp32 each per compressed matrix.

Order and overlap. Collectives must be issued in the same order on every rank, so
round 2 never starts on "round 1 has landed", which ranks may observe at different
times: `advance()` starts it at the next bucket's launch (waiting for round 1 if it
has not landed) or when the bucket is waited for; both are points every rank
reaches in the same order. So round 1 of a bucket overlaps the backward up to the
next bucket's launch, and round 2 the backward after it; the host blocks only on a
round 1 (the P factors: small, latency-bound) still in flight at that launch. The
last bucket's round 2 and every bucket's decompression run in `finish_grad_sync`,
where today's gloo path sums its receive buffers. On GPUs a wait is a stream
dependency, not a host block.

Buffers of the exactly summed parts are all-reduced (2 (DP-1)/DP of their size on the
wire, where a reduce-scatter moves (DP-1)/DP): they are small, and one collective per
round beats two. The parameter all-gather after the update is not compressed (it is
exact by nature), so a sharded mode saves at most the gradient part of its traffic:
half with fp32 parameters, two thirds with bf16 ones (fp32 sums, a bf16 all-gather).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from .buffers import Bucket, Slot


def compression_rank(shape: torch.Size, rank: int, min_compression_rate: float) -> int:
    """The rank k a gradient of `shape` (a matrix, or a stack of them) is compressed at, or 0 when it is summed
    exactly."""
    if len(shape) not in (2, 3):
        return 0
    m, n = shape[-2:]
    k = min(rank, m, n)
    return k if m * n >= min_compression_rate * k * (m + n) else 0


class _Matrix:
    """One compressed gradient, a stack of B matrices (B = 1 for a plain matrix): its main grad `[B, m, n]` and
    views of its P `[B, m, k]` and Q `[B, n, k]`."""

    def __init__(self, slot: Slot, p: torch.Tensor, q: torch.Tensor):
        self.slot, self.p, self.q = slot, p, q
        self.grad = slot.param.main_grad.view(p.shape[0], p.shape[1], -1)

    def rows_of_sum(self, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of the flattened decompressed sum P Q^T, computing only their rows."""
        m, n = self.grad.shape[1:]
        r0, r1 = lo // n, -(-hi // n)  # rows of the stack seen as [B·m, n]
        rows = [self.p[b, max(r0 - b * m, 0) : min(r1 - b * m, m)] @ self.q[b].T
                for b in range(r0 // m, -(-r1 // m))]
        return torch.cat(rows).view(-1)[lo - r0 * n : hi - r0 * n]


class _Plan:
    """A bucket's compressed matrices, its exactly summed slots, and their flat buffers."""

    def __init__(self, bucket: Bucket, ranks: dict[str, int], group, shard: int):
        self.bucket, self.group, self.shard = bucket, group, shard
        device = bucket.grad_buf.device
        shapes = {s.name: (-1, *s.param.shape[-2:]) for s in bucket.slots}  # [B, m, n]: a matrix is B = 1
        compressed = [s for s in bucket.slots if s.name in ranks]
        exact = [s for s in bucket.slots if s.name not in ranks]
        stacks = {s.name: s.numel // (shapes[s.name][1] * shapes[s.name][2]) for s in compressed}
        p_sizes = [stacks[s.name] * shapes[s.name][1] * ranks[s.name] for s in compressed]
        q_sizes = [stacks[s.name] * shapes[s.name][2] * ranks[s.name] for s in compressed]
        # round 1 sends [P of every matrix, then every exactly summed gradient]; round 2 every Q
        self.round1 = torch.zeros(sum(p_sizes) + sum(s.numel for s in exact), device=device)
        self.q = torch.zeros(sum(q_sizes), device=device)
        ps = self.round1.split(p_sizes + [s.numel for s in exact])
        qs = self.q.split(q_sizes)
        self.matrices = {s.name: _Matrix(s, p.view(stacks[s.name], shapes[s.name][1], -1),
                                         q.view(stacks[s.name], shapes[s.name][2], -1))
                         for s, p, q in zip(compressed, ps, qs)}
        self.exact = {s.name: (s, v) for s, v in zip(exact, ps[len(compressed):])}  # name -> (slot, its sum)
        self.residual = torch.zeros(bucket.shard_size, device=device)  # E_i where this rank's shard gets the sum

    def owned(self) -> torch.Tensor:
        return self.bucket.shard(self.bucket.grad_buf, self.shard)

    def first_round(self) -> None:
        for mat in self.matrices.values():
            mat.q.copy_(torch.linalg.qr(mat.q).Q)
            torch.matmul(mat.grad, mat.q, out=mat.p)
        for slot, total in self.exact.values():
            total.copy_(slot.param.main_grad.view(-1))

    def second_round(self) -> None:
        for mat in self.matrices.values():
            mat.p.copy_(torch.linalg.qr(mat.p).Q)
            torch.matmul(mat.grad.mT, mat.p, out=mat.q)
            mat.grad.baddbmm_(mat.p, mat.q.mT, alpha=-1.0)  # M_i -> E_i

    def write_sum(self) -> None:
        """Put this rank's shard of the sum into the owned gradient shard, its residual aside."""
        owned, base = self.owned(), self.shard * self.bucket.shard_size
        for slot, lo, hi in self.bucket.segments(self.shard):
            a, b = slot.offset + lo - base, slot.offset + hi - base
            mat = self.matrices.get(slot.name)
            if mat is None:
                owned[a:b].copy_(self.exact[slot.name][1][lo:hi])
            else:
                self.residual[a:b].copy_(owned[a:b])
                owned[a:b].copy_(mat.rows_of_sum(lo, hi))

    def keep_residuals(self) -> None:
        """Zero the exactly summed gradients and set the compressed ones to their residuals E_i."""
        for slot, _ in self.exact.values():
            slot.param.main_grad.zero_()
        self.owned().copy_(self.residual)  # zero outside compressed segments: padding and exact slots


class _Reduction:
    """One bucket in flight: round 1, then round 2 once `PowerSGD.advance` says so; `wait` writes the sum."""

    def __init__(self, owner: PowerSGD, plan: _Plan):
        self.owner, self.plan, self.in_round2, self.done = owner, plan, False, False
        plan.first_round()
        self.work = dist.all_reduce(plan.round1, group=plan.group, async_op=True)

    def start_round2(self) -> None:
        self.work.wait()
        self.plan.second_round()
        self.work = dist.all_reduce(self.plan.q, group=self.plan.group, async_op=True)
        self.in_round2 = True

    def is_completed(self) -> bool:
        return self.done or (self.in_round2 and self.work.is_completed())

    def wait(self) -> None:
        if self.done:
            return
        if not self.in_round2:
            self.owner.advance()
        self.work.wait()
        self.plan.write_sum()
        self.done = True


class PowerSGD:
    """Compressed DP sums of `buckets`: bucket b is summed over `group_of(b)`, and this rank keeps
    its shard `shard_of(b)` (data_parallel.py: the DP group, or for expert buckets at EP > 1 the
    expert-DP group; every rank of a group holds the same buckets, so their plans and Q match).

    The caller (grad_sync.py) launches a bucket with `launch`, calls `advance` before
    every launch, waits the returned handle, and calls `keep_residuals` instead of
    zeroing a compressed bucket after the update."""

    def __init__(self, buckets: list[Bucket], group_of: Callable[[Bucket], object], shard_of: Callable[[Bucket], int],
                 rank: int, min_compression_rate: float, seed: int = 0):
        self.seed = seed
        self.plans: dict[int, _Plan] = {}
        for b in buckets:
            ranks = {s.name: k for s in b.slots if (k := compression_rank(s.param.shape, rank, min_compression_rate))}
            if ranks:
                self.plans[b.index] = _Plan(b, ranks, group_of(b), shard_of(b))
        self._round1: list[_Reduction] = []
        self.reset()

    def matrices(self) -> list[tuple[Bucket, _Matrix]]:
        return [(plan.bucket, mat) for plan in self.plans.values() for mat in plan.matrices.values()]

    def compresses(self, b: Bucket) -> bool:
        return b.index in self.plans

    def launch(self, b: Bucket) -> _Reduction:
        r = _Reduction(self, self.plans[b.index])
        self._round1.append(r)
        return r

    def advance(self) -> None:
        """Start round 2 of every bucket still in round 1, in launch order (see the module docstring)."""
        for r in self._round1:
            r.start_round2()
        self._round1.clear()

    def keep_residuals(self, b: Bucket) -> None:
        self.plans[b.index].keep_residuals()

    def reset(self) -> None:
        """Start afresh: Q from the seeded sample, no residuals (at start, and after a non-finite step)."""
        g = torch.Generator().manual_seed(self.seed)
        for _, mat in self.matrices():
            mat.q.copy_(torch.randn(mat.q.shape, generator=g))
            mat.grad.zero_()
        for plan in self.plans.values():
            plan.residual.zero_()

    def state_bytes(self) -> int:
        """Bytes this rank holds beyond the buffers it shares: P, Q and the owned shards' residuals."""
        return 4 * sum(p.round1.numel() + p.q.numel() + p.residual.numel() for p in self.plans.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Q and the residual E_i of every compressed matrix, between steps, by `<chunk>/<parameter>`."""
        out = {}
        for b, mat in self.matrices():
            # Shaped by the parameter (a plain matrix's Q is [n, k]), so files from before stacks existed still load.
            out[f"{b.chunk}/{mat.slot.name}/q"] = mat.q.view(*mat.slot.param.shape[:-2], *mat.q.shape[1:])
            out[f"{b.chunk}/{mat.slot.name}/residual"] = mat.slot.param.main_grad
        return out
