"""One object that owns every process group, built from the rank grid.

Rank grid (Megatron's order): TP varies fastest, then CP, then DP, then PP, so the
TP ranks of one replica are neighbours (inside one node), the context-parallel ranks
that exchange K/V every layer come next, and pipeline neighbours are `tp * cp * dp`
ranks apart:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

At CP = 1 this is the TP x DP x PP numbering, unchanged.

Expert parallelism (EP) splits the DP dimension for expert layers only (Megatron's
convention): the DP index is `dp_rank = ep_rank + ep * edp_rank`, so the EP ranks
that exchange tokens are DP neighbours. Each EP rank holds `experts / ep` experts;
the expert-data-parallel group (same TP, PP and EP coordinates, `dp / ep` ranks)
holds identical experts and sums their gradients, as the DP group does for every
other parameter. With `ep == 1` the expert-data-parallel group is the DP group.

Context parallelism (CP, `parallel/context.py`) splits every sequence over `cp` ranks
that share TP, DP and PP coordinates: they see the same samples (the data pipeline
shards by DP rank only) and hold the same weights, each computing its part of the
tokens. Their gradients are partial sums over tokens exactly as DP replicas' are, so
the gradient reduction and the optimizer's shards span DP x CP (`dp_cp_group`,
`dp_cp` ranks, `dp_cp_rank = cp_rank + cp * dp_rank`, contiguous in the grid), and
expert gradients span expert-DP x CP. At CP = 1 both are the DP and expert-DP groups
and no group is added.

`ParallelState` is passed explicitly to everything that communicates. The only
global is `torch.distributed`'s default group, which the launcher sets up.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import LayoutError, UnsupportedConfigError
from .rendezvous import round_store

BACKEND_ENV = "HFMEG_BACKEND"  # "gloo" or "nccl": overrides the default choice of ParallelState.from_env


def choose_backend(requested: str | None, local_rank: int) -> tuple[str, torch.device]:
    """The process-group backend and the device a rank computes on; the backend decides the device.

    gloo computes on the CPU, also on a machine with GPUs (so CPU test worlds stay CPU);
    nccl on `cuda:local_rank`. Without a request, nccl when CUDA is available, else gloo.
    CUDA is only queried when the answer can be nccl.
    """
    backend = (requested or ("nccl" if torch.cuda.is_available() else "gloo")).lower()
    if backend == "gloo":
        return backend, torch.device("cpu")
    if backend != "nccl":
        raise UnsupportedConfigError(f"{BACKEND_ENV}/backend: {requested!r} is not supported (use gloo or nccl)")
    if not torch.cuda.is_available():
        raise UnsupportedConfigError(f"{BACKEND_ENV}/backend: nccl needs CUDA, and no CUDA device is available")
    count = torch.cuda.device_count()
    if not 0 <= local_rank < count:
        raise LayoutError(f"LOCAL_RANK={local_rank} but this node has {count} visible CUDA device(s): "
                          f"start at most {count} processes per node")
    return backend, torch.device("cuda", local_rank)


@dataclass(frozen=True)
class ParallelConfig:
    """The layout a run asks for; DP is whatever is left of the world."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline chunks per rank (interleaved 1F1B when > 1)
    sequence_parallel: bool = False
    ep: int = 1  # expert-parallel ranks (a divisor of DP): MoE experts split over them, tokens exchanged all-to-all
    cp: int = 1  # context-parallel ranks: each sequence split over them (parallel/context.py)


class ParallelState:
    """Process groups for one rank of a TP x CP x DP x PP grid.

    Every group is created on every rank in the same order, as torch.distributed
    requires, even the ones this rank is not in.
    """

    def __init__(self, config: ParallelConfig, rank: int, world_size: int, device: torch.device):
        tp, pp, cp = config.tp, config.pp, config.cp
        if tp < 1 or pp < 1 or cp < 1 or world_size % (tp * cp * pp) != 0:
            raise LayoutError(
                f"world size {world_size} is not a multiple of TP x CP x PP = {tp} x {cp} x {pp}"
            )
        if config.vpp < 1:
            raise LayoutError(f"vpp must be >= 1, got {config.vpp}")
        dp = world_size // (tp * cp * pp)
        if config.ep < 1 or dp % config.ep:
            raise LayoutError(f"ep={config.ep} must divide the data-parallel size {dp} "
                              f"(world {world_size} / (TP {tp} x CP {cp} x PP {pp}))")
        if config.sequence_parallel and tp == 1:
            config = replace(config, sequence_parallel=False)
        self.config = config
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tp, self.pp, self.cp = tp, pp, cp
        self.dp = dp
        self.dp_cp = dp * cp  # replicas of the weights: the gradient reduction's size
        self.vpp = config.vpp
        self.sequence_parallel = config.sequence_parallel
        self.tp_rank = rank % tp
        self.cp_rank = (rank // tp) % cp
        self.dp_rank = (rank // (tp * cp)) % dp
        self.dp_cp_rank = (rank // tp) % self.dp_cp
        self.pp_rank = rank // (tp * self.dp_cp)
        self.ep = config.ep
        self.ep_rank = self.dp_rank % self.ep
        # The expert-DP group spans (dp / ep) x cp ranks; its rank order is the grid's: CP fastest.
        self.edp = (dp // self.ep) * cp
        self.edp_rank = self.cp_rank + cp * (self.dp_rank // self.ep)

        replica = lambda r: (r // tp) % self.dp_cp  # noqa: E731 - the DP x CP coordinate
        stage = lambda r: r // (tp * self.dp_cp)  # noqa: E731
        dp_of = lambda r: replica(r) // cp  # noqa: E731
        self.tp_group = self._build(lambda r: (r // tp), "tp")
        self.dp_group = self._build(lambda r: (r % tp, stage(r), replica(r) % cp), "dp")
        self.pp_group = self._build(lambda r: r % (tp * self.dp_cp), "pp")
        # Model-parallel group (TP x PP of one replica): norms of sharded tensors reduce here.
        self.mp_group = self._build(replica, "mp")
        # First and last stage of each pipeline: tied-embedding gradients are summed here.
        self.embedding_group = self._build_embedding_group()
        # Context parallelism: the CP group exchanges K/V; gradients are summed over DP x CP.
        # Built only for CP > 1: at CP = 1 `cp_group` is None and the DP x CP group is the DP group.
        self.cp_group, self.dp_cp_group = None, self.dp_group
        if cp > 1:
            self.cp_group = self._build(lambda r: (r % tp, stage(r), dp_of(r)), "cp")
            self.dp_cp_group = self._build(lambda r: (r % tp, stage(r)), "dp_cp")
        # Expert layers: tokens travel over the EP group, expert gradients are summed over the expert-DP group.
        # Built only for EP > 1, so dense runs create no extra groups; `ep_group` is None at EP = 1.
        self.ep_group, self.expert_dp_group = None, self.dp_cp_group
        if self.ep > 1:
            self.ep_group = self._build(lambda r: (r % tp, stage(r), replica(r) % cp, dp_of(r) // self.ep), "ep")
            self.expert_dp_group = self._build(lambda r: (r % tp, stage(r), dp_of(r) % self.ep), "expert_dp")

    # -- construction ---------------------------------------------------------
    def _build(self, key, name: str):
        """Partition all ranks by `key(rank)`; return this rank's group."""
        buckets: dict = {}
        for r in range(self.world_size):
            buckets.setdefault(key(r), []).append(r)
        mine = None
        for k in sorted(buckets):
            ranks = buckets[k]
            group = dist.new_group(ranks) if self.world_size > 1 else None
            if self.rank in ranks:
                mine = group
                setattr(self, f"{name}_ranks", ranks)
        return mine

    def _build_embedding_group(self):
        stride = self.tp * self.dp_cp
        mine = None
        self.embedding_ranks: list[int] = []
        for col in range(stride):
            ranks = [col] if self.pp == 1 else [col, col + (self.pp - 1) * stride]
            group = dist.new_group(ranks) if self.world_size > 1 else None
            if self.rank in ranks:
                mine, self.embedding_ranks = group, ranks
        return mine

    @classmethod
    def from_env(cls, config: ParallelConfig, *, backend: str | None = None,
                 timeout_s: float = 600.0) -> "ParallelState":
        """Join the job the environment describes (`join_world`) and build this rank's groups."""
        device = join_world(backend=backend, timeout_s=timeout_s)
        return cls(config, dist.get_rank(), dist.get_world_size(), device)

    # -- pipeline helpers -------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the stage `pp_rank` that shares this rank's TP, CP and DP coordinates."""
        return self.tp_rank + self.tp * (self.dp_cp_rank + self.dp_cp * pp_rank)

    @property
    def next_rank(self) -> int:
        return self.stage_rank((self.pp_rank + 1) % self.pp)

    @property
    def prev_rank(self) -> int:
        return self.stage_rank((self.pp_rank - 1) % self.pp)

    def __repr__(self) -> str:
        return (
            f"ParallelState(rank={self.rank}, tp={self.tp_rank}/{self.tp}, cp={self.cp_rank}/{self.cp}, "
            f"dp={self.dp_rank}/{self.dp}, "
            f"pp={self.pp_rank}/{self.pp}, vpp={self.vpp}, sp={self.sequence_parallel})"
        )


def join_world(*, backend: str | None = None, timeout_s: float = 600.0) -> torch.device:
    """Join the job that `torchrun` / `accelerate launch` describe in the environment; the rank's device.

    The backend is `backend`, else `$HFMEG_BACKEND`, else nccl when CUDA is available
    and gloo otherwise (`choose_backend`); an already initialised default group (e.g.
    `launch.spawn`'s gloo world) keeps its own. The CUDA device is bound before the
    group is created, so NCCL's communicator is built on it. A single process without
    launcher variables runs as a world of one. Separate from `ParallelState` because a
    run may need the world before it knows its layout (the trainer's `--layout auto`
    chooses on rank 0 and broadcasts the choice).
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_initialized():  # a mixed "cpu:gloo,cuda:nccl" group (torch's default with CUDA) computes on CUDA
        backend, device = choose_backend("nccl" if "nccl" in dist.get_backend() else "gloo", local)
    else:
        backend, device = choose_backend(backend or os.environ.get(BACKEND_ENV), local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = dict(backend=backend, timeout=timedelta(seconds=timeout_s),
                      device_id=device if device.type == "cuda" else None)
        if "RANK" in os.environ:
            with round_store(timeout_s) as store:  # torchrun's store outlives a restart: a prefix per round
                dist.init_process_group(**kwargs, **store)
        else:  # a plain `python` run: an in-process store, so no port can clash with another job
            dist.init_process_group(store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return device
