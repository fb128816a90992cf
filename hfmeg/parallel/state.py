"""One object that owns every process group, built from the rank grid (`grid.RankGrid`).

The grid (`parallel/grid.py`) says which ranks form each group, where each rank sits and
which groups cross hosts; this file turns it into torch.distributed groups and joins the
job's world. Context parallelism (CP, `parallel/context.py`) splits every sequence over `cp`
ranks that share TP, DP and PP coordinates: they see the same samples (the data pipeline
shards by DP rank only) and hold the same weights, so the gradient reduction and the
optimizer's shards span DP x CP (`dp_cp_group`), and expert gradients span expert-DP x CP.
At CP = 1 both are the DP and expert-DP groups and no group is added; at EP = 1 no EP
group is added and the expert-DP group is the DP x CP group.

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
from .grid import RankGrid, RankPlace
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
    """The layout a run asks for; DP is whatever is left of the world (`grid`)."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline chunks per rank (interleaved 1F1B when > 1)
    sequence_parallel: bool = False
    ep: int = 1  # expert-parallel ranks (a divisor of DP): MoE experts split over them, tokens exchanged all-to-all
    cp: int = 1  # context-parallel ranks: each sequence split over them (parallel/context.py)
    # let TP and EP groups span hosts (refused by default: grid.RankGrid.check_hosts says why)
    allow_cross_host: bool = False

    def grid(self, world_size: int, per_host: int = 0) -> RankGrid:
        """This layout on `world_size` ranks, `per_host` on each host (0: all on one)."""
        return RankGrid.of_world(world_size, tp=self.tp, cp=self.cp, pp=self.pp, ep=self.ep, vpp=self.vpp,
                                 sequence_parallel=self.sequence_parallel, per_host=per_host)


class ParallelState(RankPlace):
    """Process groups for one rank of a TP x CP x DP x PP grid, beside its place in the grid.

    Every group is created on every rank in the same order, as torch.distributed
    requires, even the ones this rank is not in. A TP or EP group spanning hosts is
    refused unless `config.allow_cross_host`.
    """

    def __init__(self, config: ParallelConfig, rank: int, world_size: int, device: torch.device,
                 per_host: int = 0):
        grid = config.grid(world_size, per_host)
        grid.check_hosts(config.allow_cross_host)
        super().__init__(grid, rank)
        self.config = replace(config, sequence_parallel=grid.sequence_parallel)
        self.device = device
        self.embedding_ranks: list[int] = []  # a middle stage is in no embedding group
        self.tp_group = self._build("tp")
        self.dp_group = self._build("dp")
        self.pp_group = self._build("pp")
        # Model-parallel group (TP x PP of one replica): norms of sharded tensors reduce here.
        self.mp_group = self._build("mp")
        # First and last stage of each pipeline: tied-embedding gradients are summed here.
        self.embedding_group = self._build("embedding")
        # Context parallelism: the CP group exchanges K/V; gradients are summed over DP x CP.
        self.cp_group, self.dp_cp_group = None, self.dp_group
        if self.cp > 1:
            self.cp_group = self._build("cp")
            self.dp_cp_group = self._build("dp_cp")
        # Blocks of n consecutive TP ranks (n a proper divisor of TP): the holders of one replicated KV head
        # (`ModelConfig.kv_replicas`), whose copies' gradients are summed there. n = TP is the TP group.
        self._tp_blocks = {self.tp: self.tp_group}
        for n in range(2, self.tp):
            if self.tp % n == 0:
                self._tp_blocks[n] = self._build_blocks(n)
        # Expert layers: tokens travel over the EP group, expert gradients are summed over the expert-DP group.
        self.ep_group, self.expert_dp_group = None, self.dp_cp_group
        if self.ep > 1:
            self.ep_group = self._build("ep")
            self.expert_dp_group = self._build("expert_dp")

    def _build(self, kind: str):
        """Create every group of `kind`; return this rank's (its ranks as `<kind>_ranks`)."""
        mine = None
        for ranks in self.grid.groups(kind):
            group = dist.new_group(ranks) if self.world_size > 1 else None
            if self.rank in ranks:
                mine = group
                setattr(self, f"{kind}_ranks", ranks)
        return mine

    def _build_blocks(self, n: int):
        """Create every block of `n` consecutive ranks of each TP group; return this rank's."""
        mine = None
        for tp_ranks in self.grid.groups("tp"):
            for i in range(0, self.tp, n):
                group = dist.new_group(tp_ranks[i : i + n]) if self.world_size > 1 else None
                if self.rank in tp_ranks[i : i + n]:
                    mine = group
        return mine

    def tp_block_group(self, n: int):
        """The group of this rank's block of `n` consecutive TP ranks (`n` divides TP)."""
        return self._tp_blocks[n]

    @classmethod
    def from_env(cls, config: ParallelConfig, *, backend: str | None = None,
                 timeout_s: float = 600.0) -> "ParallelState":
        """Join the job the environment describes (`join_world`) and build this rank's groups."""
        device = join_world(backend=backend, timeout_s=timeout_s)
        return cls(config, dist.get_rank(), dist.get_world_size(), device, ranks_per_host())


def ranks_per_host() -> int:
    """The ranks on each host, as the launcher tells every rank (`LOCAL_WORLD_SIZE`); 0 (all on one) without one."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "0"))


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
