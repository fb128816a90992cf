"""Runs across namespace hosts over shaped links give the one-host run's losses, step by step.

The same layout on one host and across hosts puts every rank at the same grid coordinates and every
collective over the same ranks in the same order; only the transport differs (loopback vs a shaped veth
link), and gloo's algorithms do not depend on it. So the losses are equal bit for bit, not merely within a
rounding bound.

The one-host run is `hfmeg train` in `launch.spawn`'s forked ranks (no launcher, no interpreter started): a
rank of it computes what a torchrun worker on one host does, with one thread each, and gave the one-host
torchrun job's losses bit for bit on both layouts (2026-11-29) before it replaced that job here; the
multi-host side is torchrun's, across the bed. The TP2 x DP2 side is test_multihost_faults' uninterrupted run
(2 hosts x 2 ranks, saving every 2 steps, run once per session for the tests that compare with it): its saves
and heartbeat change no number, and the one-host run takes the same flags."""

from __future__ import annotations

import pytest

from hfmeg.parallel.launch import spawn
from hfmeg.train.cli import train_command
from hfmeg.train.metrics import read_metrics
from multihost import train_args
from test_multihost_faults import STEPS, _resumable, uninterrupted
from test_train import ALPACA, _assets

__all__ = ["uninterrupted"]  # the module fixture: the TP2 x DP2 run across hosts


def _one_host_rank(argv: list[str]) -> int:
    return train_command(argv)


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def _pp2_dp2(out) -> list[str]:
    return train_args(_assets(), ALPACA, out, "--tp", "1", "--pp", "2", steps=4)


def _tp2_dp2_run(request) -> tuple:
    return request.getfixturevalue("uninterrupted")  # TP2 inside a host, DP2 across the link


def _pp2_dp2_run(request) -> tuple:
    return request.getfixturevalue("multihost_run")("pp2-dp2_4x1", 4, 1, _pp2_dp2)


# id: (world, the job's `-m hfmeg train` arguments for an `<out>`, steps, the run across hosts: (`<out>`, logs))
CASES = {
    "tp2-dp2_2x2": (4, _resumable, STEPS, _tp2_dp2_run),
    "pp2-dp2_4x1": (4, _pp2_dp2, 4, _pp2_dp2_run),  # PP2 x DP2 on 4 x 1: every stage boundary and DP reduction a link
}


@pytest.mark.parametrize("case", CASES)
def test_multihost_losses_equal_one_host(request, tmp_path, case):
    world, args_of, steps, run = CASES[case]
    assert spawn(_one_host_rank, world, args_of(tmp_path / "one")[3:]) == [0] * world  # less `-m hfmeg train`
    one, many = _losses(tmp_path / "one"), _losses(run(request)[0])
    assert len(one) == steps and many == one, (one, many)
