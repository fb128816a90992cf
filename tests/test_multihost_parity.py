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
from test_multihost_faults import STEPS, _resumable
from test_train import ALPACA, _assets


def _one_host_rank(argv: list[str]) -> int:
    return train_command(argv)


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def _pp2_dp2(out) -> list[str]:
    return train_args(_assets(), ALPACA, out, "--tp", "1", "--pp", "2", steps=4)


# name: (hosts, ranks per host, the job's `-m hfmeg train` arguments for an `<out>`, steps, launcher's settings)
CASES = {
    "uninterrupted": (2, 2, _resumable, STEPS, {"max_restarts": 3}),  # TP2 inside a host, DP2 across the link
    "pp2-dp2_4x1": (4, 1, _pp2_dp2, 4, {}),  # PP2 x DP2: every stage boundary and DP reduction crosses a link
}


@pytest.mark.parametrize("case", CASES, ids=["tp2-dp2_2x2", "pp2-dp2_4x1"])
def test_multihost_losses_equal_one_host(multihost_run, tmp_path, case):
    hosts, per_host, args_of, steps, kw = CASES[case]
    world = hosts * per_host
    assert spawn(_one_host_rank, world, args_of(tmp_path / "one")[3:]) == [0] * world  # less `-m hfmeg train`
    many, _ = multihost_run(case, hosts, per_host, args_of, **kw)
    one, many = _losses(tmp_path / "one"), _losses(many)
    assert len(one) == steps and many == one, (one, many)
