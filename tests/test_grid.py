"""The rank grid as one value (`hfmeg/parallel/grid.py`): coordinates, groups, hosts, and each check in one place.

No process is started: the grid is pure, and `ParallelState` refuses a layout before it creates any group."""

from __future__ import annotations

import itertools
import traceback
from pathlib import Path

import pytest
import torch

from hfmeg.checkpoint.mp_layout import MPLayout
from hfmeg.errors import LayoutError
from hfmeg.families import model_config_from_hf
from hfmeg.parallel.grid import RankGrid
from hfmeg.parallel.state import ParallelConfig, ParallelState
from hfmeg.plan.layout import PlanLayout, check_layout
from hfmeg.train.config import CheckpointArgs, ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.dataclass_io import ConfigError
from hfmeg.train.validate import validate
from tiny_models import tiny_config

ROOT = Path(__file__).resolve().parents[1]
GRIDS = [RankGrid(tp, cp, pp, dp, ep) for tp, cp, pp, dp, ep in
         [(1, 1, 1, 1, 1), (2, 1, 2, 2, 1), (2, 2, 1, 2, 2), (1, 2, 2, 4, 2), (2, 1, 1, 4, 4), (4, 2, 3, 2, 1)]]
# The coordinates a group of each kind varies (all others are equal inside one group).
VARIES = {"tp": {"tp_rank"}, "dp": {"dp_rank"}, "pp": {"pp_rank"}, "mp": {"tp_rank", "pp_rank"},
          "cp": {"cp_rank"}, "dp_cp": {"cp_rank", "dp_rank"}, "ep": {"dp_rank"}, "expert_dp": {"cp_rank", "dp_rank"}}
COORDS = ("tp_rank", "cp_rank", "dp_rank", "pp_rank")


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_coordinates_follow_the_documented_rank_formula(grid):
    """rank = tp + TP·(cp + CP·(dp + DP·pp)); dp = ep + EP·i; the expert-DP rank counts CP fastest; every
    coordinate tuple is one rank."""
    seen = set()
    for rank in range(grid.world_size):
        p = grid.place(rank)
        assert rank == p.tp_rank + grid.tp * (p.cp_rank + grid.cp * (p.dp_rank + grid.dp * p.pp_rank))
        assert rank == grid.rank(p.tp_rank, p.cp_rank, p.dp_rank, p.pp_rank)
        assert p.ep_rank == p.dp_rank % grid.ep
        assert p.edp_rank == p.cp_rank + grid.cp * (p.dp_rank // grid.ep)
        assert p.dp_cp_rank == p.cp_rank + grid.cp * p.dp_rank
        assert p.next_rank == grid.rank(p.tp_rank, p.cp_rank, p.dp_rank, (p.pp_rank + 1) % grid.pp)
        seen.add(tuple(getattr(p, c) for c in COORDS))
    assert len(seen) == grid.world_size == grid.tp * grid.cp * grid.dp * grid.pp


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_each_kind_of_group_partitions_the_ranks_by_the_coordinates_it_keeps(grid):
    kinds = [k for k in VARIES if (k not in ("cp", "dp_cp") or grid.cp > 1) and (k not in ("ep", "expert_dp")
                                                                                     or grid.ep > 1)]
    size = {"tp": grid.tp, "dp": grid.dp, "pp": grid.pp, "mp": grid.tp * grid.pp, "cp": grid.cp,
            "dp_cp": grid.dp_cp, "ep": grid.ep, "expert_dp": grid.edp}
    for kind in kinds:
        groups = grid.groups(kind)
        assert sorted(itertools.chain(*groups)) == list(range(grid.world_size)), kind
        for group in groups:
            assert len(group) == size[kind] and group == sorted(group), (kind, group)
            places = [grid.place(r) for r in group]
            for c in COORDS:
                if c not in VARIES[kind]:
                    assert len({getattr(p, c) for p in places}) == 1, (kind, c, group)
            if kind == "ep":  # the same expert-DP index: DP neighbours
                assert len({p.dp_rank // grid.ep for p in places}) == 1
            if kind == "expert_dp":  # the same EP rank: the same experts
                assert len({p.ep_rank for p in places}) == 1
        assert grid.group_of(kind, grid.world_size - 1) == groups[-1]
    with pytest.raises(LayoutError):
        RankGrid().groups("cp")  # no CP groups at CP 1


def test_hosts_hold_consecutive_ranks_and_the_grid_says_which_groups_cross_them():
    two_by_two = RankGrid(tp=2, dp=2, per_host=2)  # 2 hosts x 2 ranks: TP inside, DP across
    assert [two_by_two.place(r).host for r in range(4)] == [0, 0, 1, 1]
    assert two_by_two.crossing() == ["dp"]
    assert two_by_two.hosts_line() == "2 hosts x 2 ranks; groups crossing hosts: dp"
    four_by_one = RankGrid(pp=2, dp=2, per_host=1)  # 4 hosts x 1 rank: PP2 x DP2
    assert four_by_one.crossing() == ["dp", "pp", "mp", "embedding"]
    assert RankGrid(tp=2, dp=2).crossing() == [] and RankGrid(tp=2, dp=2).hosts == 1
    with pytest.raises(LayoutError, match="^3 ranks per host do not divide the world size 4$"):
        RankGrid(tp=2, dp=2, per_host=3)


def test_a_tp_or_ep_group_across_hosts_is_refused_unless_forced():
    with pytest.raises(LayoutError, match=r"^TP=4: its group of ranks \[0, 1, 2, 3\] spans hosts \[0, 1\] \(2 ranks "
                                          r"per host\), but tensor parallelism .* set parallel.allow_cross_host true"):
        RankGrid(tp=4, dp=2, per_host=2).check_hosts()
    with pytest.raises(LayoutError, match=r"^EP=4: its group of ranks \[0, 1, 2, 3\] spans hosts \[0, 1\]"):
        RankGrid(dp=4, ep=4, per_host=2).check_hosts()
    RankGrid(tp=4, dp=2, per_host=2).check_hosts(allow_cross_host=True)
    RankGrid(tp=2, dp=4, ep=2, per_host=4).check_hosts()  # TP 2 x EP 2 (DP neighbours) inside a host of 4
    with pytest.raises(LayoutError, match=r"^EP=2: its group of ranks \[0, 2\] spans hosts \[0, 1\]"):
        RankGrid(tp=2, dp=4, ep=2, per_host=2).check_hosts()  # TP inside, but EP's ranks are TP ranks apart
    # start-up: the process groups are never built for a refused layout
    with pytest.raises(LayoutError, match="^TP=2: its group of ranks"):
        ParallelState(ParallelConfig(tp=2), 0, 4, torch.device("cpu"), per_host=1)


def test_the_trainer_config_refuses_a_tp_group_across_hosts_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = TrainConfig(model=ModelArgs(path="m"), parallel=ParallelArgs(tp=4),
                      checkpoint=CheckpointArgs(out=str(tmp_path / "out")))
    cfg.train.global_batch_size = 2
    with pytest.raises(ConfigError, match=r"^parallel.tp: TP=4: its group of ranks \[0, 1, 2, 3\] spans hosts"):
        validate(cfg, world_size=8)
    forced = TrainConfig(model=cfg.model, parallel=ParallelArgs(tp=4, allow_cross_host=True),
                         checkpoint=cfg.checkpoint, train=cfg.train)
    assert validate(forced, world_size=8) == []


# Each check of the grid, by a fragment of its message as written in the source (placeholders and all): stated once
# in hfmeg, in grid.py.
CHECK_MESSAGES = ["{world_size} is not a multiple of TP x CP x PP", "does not divide DP={self.dp}",
                  "{global_batch} is not divisible by DP x micro-batch", "{2 * self.cp} equal chunks",
                  "do not divide over TP={self.tp}", "spans hosts {hosts}", "{self.per_host} ranks per host do not",
                  "parallel sizes must be whole numbers >= 1, got {", "but there are {world_size} ranks"]


@pytest.mark.parametrize("fragment", CHECK_MESSAGES)
def test_each_layout_check_is_stated_once(fragment):
    where = [(path, text.count(fragment)) for path in sorted((ROOT / "hfmeg").rglob("*.py"))
             if fragment in (text := path.read_text())]
    assert [(p.relative_to(ROOT).as_posix(), n) for p, n in where] == [("hfmeg/parallel/grid.py", 1)]


def _raised_by_the_grid(error: BaseException) -> LayoutError:
    """The LayoutError behind `error` (itself, or what it was raised from), checked to come from grid.py."""
    while not isinstance(error, LayoutError):
        error = error.__cause__ or error.__context__
    assert traceback.extract_tb(error.__traceback__)[-1].filename.endswith("hfmeg/parallel/grid.py")
    return error


def test_the_planner_the_trainer_config_and_conversion_raise_the_grids_error(tmp_path):
    """The same bad EP (and a size of 0) reaches the planner, the trainer's config and the runtime state as the
    grid's one error; conversion's sizes are the grid's too."""
    cfg = model_config_from_hf(tiny_config("llama3"))
    with pytest.raises(LayoutError) as planner:
        check_layout(cfg, PlanLayout(1, 1, 4, 1, ep=3), 4, 8, 16)
    train = TrainConfig(model=ModelArgs(path="m"), parallel=ParallelArgs(ep=3),
                        checkpoint=CheckpointArgs(out=str(tmp_path / "out")))
    with pytest.raises(ConfigError) as trainer:
        validate(train, world_size=4)
    with pytest.raises(LayoutError) as state:
        ParallelState(ParallelConfig(ep=3), 0, 4, torch.device("cpu"))
    messages = {str(_raised_by_the_grid(e.value)) for e in (planner, trainer, state)}
    assert messages == {"EP=3 does not divide DP=4 (expert-parallel ranks are data-parallel ranks)"}
    assert str(trainer.value) == "parallel.ep: EP=3 does not divide DP=4 (expert-parallel ranks are data-parallel ranks)"

    with pytest.raises(LayoutError) as conversion:
        MPLayout.build(cfg, tp=0, pp=1)
    with pytest.raises(LayoutError) as planner:
        check_layout(cfg, PlanLayout(1, 0, 4, 1), 4, 8, 16)
    sizes = {str(_raised_by_the_grid(e.value)) for e in (conversion, planner)}
    assert {s.split(", got")[0] for s in sizes} == {"parallel sizes must be whole numbers >= 1"}
