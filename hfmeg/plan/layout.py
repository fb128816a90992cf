"""`PlanLayout`: one candidate way to run a training step, and the checks it must pass.

Its rank grid is a `grid.RankGrid` (sizes, EP inside DP, sequence parallelism only with
TP > 1); the rest is how a step runs on it (micro-batch, recompute, optimizer, schedule).
The checks are the ones the runtime itself makes (the grid's, `config.check_tp`,
`schedules.validate`), called rather than restated, so the
planner never proposes a layout the trainer would refuse.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..config import VOCAB_MULTIPLE, ModelConfig, check_cp, check_ep, check_tp
from ..errors import HfmegError, LayoutError
from ..models.decoder import RECOMPUTE_MODES
from ..optim.config import MODES
from ..parallel.grid import RankGrid
from ..parallel.schedules import validate


@dataclass(frozen=True)
class PlanLayout:
    tp: int
    pp: int
    dp: int
    micro_batch: int
    vpp: int = 1
    recompute: str = "none"
    sequence_parallel: bool = True  # only meaningful with tp > 1
    optimizer: str = "overlapped"
    schedule: str = "1f1b"  # becomes "interleaved" when vpp > 1; "gpipe" on request
    ep: int = 1  # expert-parallel ranks, a divisor of dp (parallel/grid.py); the expert-DP group is dp / ep
    cp: int = 1  # context-parallel ranks: each row split over them (parallel/context.py)
    vocab_multiple: int = VOCAB_MULTIPLE  # the run's `model.vocab_multiple`: the LM head's padded rows

    @property
    def grid(self) -> RankGrid:
        """The rank grid (LayoutError where the sizes do not fit together)."""
        return RankGrid(self.tp, self.cp, self.pp, self.dp, self.ep, self.vpp, self.sequence_parallel)

    @property
    def edp(self) -> int:
        """Expert-DP replicas of one CP rank (the expert-DP group is this x CP)."""
        return self.dp // self.ep

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights, whose gradients are summed and optimizer sharded: DP x CP."""
        return self.dp * self.cp

    def __post_init__(self) -> None:
        if self.vpp > 1 and self.schedule == "1f1b":
            object.__setattr__(self, "schedule", "interleaved")

    @property
    def gpus(self) -> int:
        return self.grid.world_size

    @property
    def sp(self) -> bool:
        return self.grid.sequence_parallel

    def microbatches(self, global_batch: int) -> int:
        return self.grid.check_batch(global_batch, self.micro_batch)

    def name(self) -> str:
        v = f"v{self.vpp}" if self.vpp > 1 else ""
        sp = "sp" if self.sp else ""
        gpipe = "-gpipe" if self.schedule == "gpipe" else ""
        ep = f"-ep{self.ep}" if self.ep > 1 else ""
        cp = f"-cp{self.cp}" if self.cp > 1 else ""
        return (f"tp{self.tp}{sp}{cp}-pp{self.pp}{v}-dp{self.dp}{ep}-mb{self.micro_batch}-{self.recompute}-"
                f"{self.optimizer}{gpipe}")


LAYOUT_NAME = re.compile(r"^tp(\d+)(sp)?(?:-cp(\d+))?-pp(\d+)(?:v(\d+))?-dp(\d+)(?:-ep(\d+))?-mb(\d+)-(none|selective|full)"
                         r"(?:-(overlapped|distributed|ddp))?(-gpipe)?$")


def parse_layout(text: str) -> PlanLayout:
    """The inverse of `PlanLayout.name` (what `--explain` takes)."""
    m = LAYOUT_NAME.match(text)
    if not m:
        raise LayoutError(f"--explain {text!r}: expected a layout name like tp2sp-pp4v2-dp16-mb1-selective "
                          "(MoE: tp1-pp1-dp8-ep4-mb1-none)")
    tp, sp, cp, pp, vpp, dp, ep, mb, rec, opt, gpipe = m.groups()
    return PlanLayout(int(tp), int(pp), int(dp), int(mb), int(vpp or 1), rec, sp is not None or int(tp) == 1,
                      opt or "overlapped", "gpipe" if gpipe else "1f1b", int(ep or 1), int(cp or 1))


def check_layout(cfg: ModelConfig, lay: PlanLayout, gpus: int, global_batch: int, seq_len: int) -> None:
    """Raise LayoutError (one line) when `lay` cannot run this job."""
    grid = lay.grid
    grid.check_size(gpus)
    if lay.recompute not in RECOMPUTE_MODES:
        raise LayoutError(f"--recompute {lay.recompute!r}: choose one of {RECOMPUTE_MODES}")
    if lay.optimizer not in MODES:
        raise LayoutError(f"--optimizer {lay.optimizer!r}: choose one of {MODES}")
    grid.check_batch(global_batch, lay.micro_batch)
    grid.check_sequence(seq_len)
    try:
        check_tp(cfg, lay.tp)
        check_ep(cfg, lay.ep)
        check_cp(cfg, lay.cp)
        validate(lay.schedule, lay.pp, lay.vpp, lay.microbatches(global_batch))
    except HfmegError as e:
        raise LayoutError(str(e)) from e
