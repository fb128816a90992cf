"""`RankGrid`: the rank grid of a run as one pure value, and every check of its arithmetic.

The grid is TP x CP x DP x PP ranks, EP inside DP, in Megatron's order: TP varies fastest,
then CP, then DP, then PP, so the TP ranks of one replica are neighbours (inside a host),
the context-parallel ranks that exchange K/V every layer come next, and pipeline neighbours
are `tp * cp * dp` ranks apart:

    rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

Expert parallelism splits the DP index for expert layers (`dp_rank = ep_rank + ep * i`), so the
EP ranks that exchange tokens are DP neighbours; the expert-DP group (same TP, PP and EP
coordinates) spans the other `dp / ep` DP ranks and CP. Gradients are summed over DP x CP
(`dp_cp_rank = cp_rank + cp * dp_rank`, contiguous in the grid), expert gradients over expert-DP x CP.

Hosts hold `per_host` consecutive ranks each (what torchrun and accelerate give every node:
`LOCAL_WORLD_SIZE` ranks, numbered node by node), so a group crosses hosts exactly when its
ranks fall into more than one such block. TP (every layer's activations) and EP (every MoE
layer's tokens) are refused across hosts unless forced: `check_hosts`.

The value is pure (no process, no torch.distributed): the trainer's `ParallelState` builds its
process groups from `groups`, and the planner, conversion and PEFT build models for ranks that
are not processes from `place(rank)`. Checks against a model (heads, experts) stay in
`config.py`; the checks here are the grid's alone, each stated once.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LayoutError

# The kinds of process group `groups` gives (CP and EP kinds only where CP > 1, EP > 1).
GROUP_KINDS = ("tp", "dp", "pp", "mp", "cp", "dp_cp", "ep", "expert_dp", "embedding")
KEPT_INSIDE_A_HOST = {"tp": "tensor parallelism exchanges activations in every layer",
                      "ep": "expert parallelism exchanges every MoE layer's tokens all-to-all"}


def check_world(world_size: int, tp: int, cp: int, pp: int) -> int:
    """The data-parallel size a world of `world_size` ranks leaves at TP x CP x PP."""
    if min(tp, cp, pp) < 1 or world_size % (tp * cp * pp):
        raise LayoutError(f"world size {world_size} is not a multiple of TP x CP x PP = {tp} x {cp} x {pp}")
    return world_size // (tp * cp * pp)


@dataclass(frozen=True)
class RankGrid:
    """Sizes of each parallelism and the ranks per host; checked when made."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert-parallel ranks, a divisor of dp
    vpp: int = 1  # virtual pipeline chunks per rank (interleaved 1F1B when > 1)
    sequence_parallel: bool = False  # only with tp > 1: set off otherwise
    per_host: int = 0  # ranks per host (torchrun's --nproc-per-node, LOCAL_WORLD_SIZE); 0: one host holds all

    def __post_init__(self) -> None:
        sizes = {"TP": self.tp, "CP": self.cp, "PP": self.pp, "DP": self.dp, "EP": self.ep, "VPP": self.vpp}
        bad = [f"{k}={v}" for k, v in sizes.items() if not (isinstance(v, int) and v >= 1)]
        if bad:
            raise LayoutError(f"parallel sizes must be whole numbers >= 1, got {', '.join(bad)}")
        if self.dp % self.ep:
            raise LayoutError(f"EP={self.ep} does not divide DP={self.dp} (expert-parallel ranks are data-parallel "
                              "ranks)")
        if self.per_host < 0 or (self.per_host and self.world_size % self.per_host):
            raise LayoutError(f"{self.per_host} ranks per host do not divide the world size {self.world_size}")
        if self.sequence_parallel and self.tp == 1:
            object.__setattr__(self, "sequence_parallel", False)

    @classmethod
    def of_world(cls, world_size: int, *, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1, vpp: int = 1,
                 sequence_parallel: bool = False, per_host: int = 0) -> "RankGrid":
        """The grid of a world of `world_size` ranks: DP is whatever TP x CP x PP leave."""
        return cls(tp, cp, pp, check_world(world_size, tp, cp, pp), ep, vpp, sequence_parallel, per_host)

    # -- sizes ------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def dp_cp(self) -> int:
        """Replicas of the weights: the size of the gradient reduction (DP x CP)."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """The expert-DP group's size: replicas of one EP rank's experts, over DP / EP and CP."""
        return (self.dp // self.ep) * self.cp

    @property
    def hosts(self) -> int:
        return self.world_size // self.per_host if self.per_host else 1

    def check_size(self, world_size: int) -> None:
        """Refuse a grid whose ranks are not the `world_size` ranks there are."""
        if self.world_size != world_size:
            raise LayoutError(f"TP x CP x PP x DP = {self.tp} x {self.cp} x {self.pp} x {self.dp} = "
                              f"{self.world_size}, but there are {world_size} ranks")

    def check_batch(self, global_batch: int, micro_batch: int) -> int:
        """The micro-batches each DP rank runs per step; refuses a global batch DP x micro-batch does not divide."""
        if micro_batch < 1 or global_batch % (self.dp * micro_batch):
            raise LayoutError(f"global batch {global_batch} is not divisible by DP x micro-batch = "
                              f"{self.dp} x {micro_batch}")
        return global_batch // (self.dp * micro_batch)

    def check_sequence(self, seq_len: int) -> None:
        """Refuse a row length that CP's 2 x CP chunks (parallel/context.py) or sequence parallelism cannot cut."""
        if self.cp > 1 and seq_len % (2 * self.cp):
            raise LayoutError(f"sequence length {seq_len} does not split into 2 x CP = {2 * self.cp} equal chunks; "
                              f"use a multiple of {2 * self.cp}")
        if self.sequence_parallel and (seq_len // self.cp) % self.tp:
            raise LayoutError(f"the {seq_len // self.cp} tokens of each CP rank (sequence length {seq_len} / "
                              f"CP={self.cp}) do not divide over TP={self.tp} (sequence parallelism)")

    # -- one rank ---------------------------------------------------------------
    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        """The rank at these coordinates."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def place(self, rank: int) -> "RankPlace":
        """Rank `rank`'s coordinates and host (no process groups)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the grid's {self.world_size} ranks")
        return RankPlace(self, rank)

    def host(self, rank: int) -> int:
        return rank // self.per_host if self.per_host else 0

    # -- groups -----------------------------------------------------------------
    def groups(self, kind: str) -> list[list[int]]:
        """Every group of `kind` (one of GROUP_KINDS), each in rank order, the groups ordered by what they share.

        `dp_cp`, `cp` exist at CP > 1 and `ep`, `expert_dp` at EP > 1 only (at CP = 1 the DP x CP
        group is the DP group; at EP = 1 the expert-DP group is the DP x CP group). `embedding`:
        the first and last stage of each pipeline, where tied embedding gradients are summed."""
        if kind == "embedding":
            stride = self.tp * self.dp_cp
            return [[col] if self.pp == 1 else [col, col + (self.pp - 1) * stride] for col in range(stride)]
        key = self._shared(kind)
        buckets: dict = {}
        for r in range(self.world_size):
            buckets.setdefault(key(self.place(r)), []).append(r)
        return [buckets[k] for k in sorted(buckets)]

    def _shared(self, kind: str):
        if kind == "tp":
            return lambda p: p.rank // self.tp
        if kind == "dp":
            return lambda p: (p.tp_rank, p.pp_rank, p.cp_rank)
        if kind == "pp":
            return lambda p: p.rank % (self.tp * self.dp_cp)
        if kind == "mp":  # TP x PP of one replica: norms of sharded tensors reduce here
            return lambda p: p.dp_cp_rank
        if kind == "cp" and self.cp > 1:
            return lambda p: (p.tp_rank, p.pp_rank, p.dp_rank)
        if kind == "dp_cp" and self.cp > 1:
            return lambda p: (p.tp_rank, p.pp_rank)
        if kind == "ep" and self.ep > 1:
            return lambda p: (p.tp_rank, p.pp_rank, p.cp_rank, p.dp_rank // self.ep)
        if kind == "expert_dp" and self.ep > 1:
            return lambda p: (p.tp_rank, p.pp_rank, p.ep_rank)
        raise LayoutError(f"no {kind!r} groups in {self}")

    def group_of(self, kind: str, rank: int) -> list[int]:
        return next(g for g in self.groups(kind) if rank in g)

    def crossing(self) -> list[str]:
        """The kinds of group (of those this grid has) with a group whose ranks sit on more than one host."""
        if self.hosts == 1:
            return []
        kinds = [k for k in GROUP_KINDS if k not in ("cp", "dp_cp") or self.cp > 1]
        kinds = [k for k in kinds if k not in ("ep", "expert_dp") or self.ep > 1]
        return [k for k in kinds if any(len({self.host(r) for r in g}) > 1 for g in self.groups(k))]

    def hosts_line(self) -> str:
        """One line saying where the hosts are in the grid and which kinds of group cross them."""
        crossing = self.crossing()
        return (f"{self.hosts} hosts x {self.per_host or self.world_size} ranks; groups crossing hosts: "
                f"{', '.join(crossing) or 'none'}")

    def check_hosts(self, allow_cross_host: bool = False) -> None:
        """Refuse a TP or EP group that spans hosts (one line saying why), unless `allow_cross_host`."""
        if allow_cross_host:
            return
        for kind in (k for k in KEPT_INSIDE_A_HOST if k in self.crossing()):
            group = next(g for g in self.groups(kind) if len({self.host(r) for r in g}) > 1)
            hosts = sorted({self.host(r) for r in group})
            raise LayoutError(f"{kind.upper()}={getattr(self, kind)}: its group of ranks {group} spans hosts {hosts} "
                              f"({self.per_host} ranks per host), but {KEPT_INSIDE_A_HOST[kind]}, which a link "
                              f"between hosts slows many times over; keep each {kind.upper()} group inside a host "
                              "(a smaller size, or more ranks per host), or set parallel.allow_cross_host true to run "
                              "it anyway")


class RankPlace:
    """One rank of a grid: its coordinates, the grid's sizes under the names `ParallelState` gives them, and its
    host. A place alone has no process groups (they are None): what is built for a rank that is not a
    process (chunks on the meta device, the planner's counts, adapter shards) never communicates."""

    tp_group = dp_group = pp_group = mp_group = cp_group = dp_cp_group = ep_group = expert_dp_group = None
    embedding_group = None

    def __init__(self, grid: RankGrid, rank: int):
        self.grid, self.rank, self.world_size = grid, rank, grid.world_size
        self.tp, self.cp, self.pp, self.dp, self.ep, self.vpp = grid.tp, grid.cp, grid.pp, grid.dp, grid.ep, grid.vpp
        self.dp_cp, self.edp = grid.dp_cp, grid.edp
        self.sequence_parallel = grid.sequence_parallel
        self.tp_rank = rank % grid.tp
        self.cp_rank = (rank // grid.tp) % grid.cp
        self.dp_rank = (rank // (grid.tp * grid.cp)) % grid.dp
        self.dp_cp_rank = (rank // grid.tp) % grid.dp_cp
        self.pp_rank = rank // (grid.tp * grid.dp_cp)
        self.ep_rank = self.dp_rank % grid.ep
        # The expert-DP group's rank order is the grid's: CP fastest.
        self.edp_rank = self.cp_rank + grid.cp * (self.dp_rank // grid.ep)
        self.host = grid.host(rank)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, tp={self.tp_rank}/{self.tp}, cp={self.cp_rank}/{self.cp}, "
                f"dp={self.dp_rank}/{self.dp}, pp={self.pp_rank}/{self.pp}, vpp={self.vpp}, "
                f"sp={self.sequence_parallel})")

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
