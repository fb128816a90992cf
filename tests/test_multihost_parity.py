"""Runs across namespace hosts over shaped links give the one-host run's losses, step by step.

The same layout on one host and across hosts puts every rank at the same grid coordinates and every
collective over the same ranks in the same order; only the transport differs (loopback vs a shaped veth
link), and gloo's algorithms do not depend on it. So the losses are equal bit for bit, not merely within a
rounding bound.

The one-host run is `hfmeg train` in `launch.spawn`'s forked ranks (no launcher, no interpreter started): a
rank of it computes what a torchrun worker on one host does, with one thread each, and gave the one-host
torchrun job's losses bit for bit on both layouts (2026-11-29) before it replaced that job here; the
multi-host side is torchrun's, across the bed."""

from __future__ import annotations

import pytest

from hfmeg.parallel.launch import spawn
from hfmeg.train.cli import train_command
from hfmeg.train.metrics import read_metrics
from multihost import recipe_flags, run_job, train_args
from test_train import ALPACA, _assets


def _one_host_rank(argv: list[str]) -> int:
    return train_command(argv)


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


@pytest.mark.parametrize("hosts, per_host, flags", [
    (2, 2, ["--tp", "2"]),  # TP2 inside a host, DP2 across the link
    (4, 1, ["--tp", "1", "--pp", "2"]),  # PP2 x DP2: every stage boundary and DP reduction crosses a link
], ids=["tp2-dp2_2x2", "pp2-dp2_4x1"])
def test_multihost_losses_equal_one_host(namespace_hosts, tmp_path, hosts, per_host, flags):
    model = _assets()
    steps = 4
    world = hosts * per_host
    one = ["--recipe", "sft_llama13b", *recipe_flags(model, ALPACA, tmp_path / "one", *flags, steps=steps)]
    assert spawn(_one_host_rank, world, one) == [0] * world
    bed = namespace_hosts(hosts)
    run_job(bed, per_host, train_args(model, ALPACA, tmp_path / "many", *flags, steps=steps), tmp_path / "logs-many")
    one, many = _losses(tmp_path / "one"), _losses(tmp_path / "many")
    assert len(one) == steps and many == one, (bed.shaping, one, many)
