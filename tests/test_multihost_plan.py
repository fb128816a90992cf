"""The planner on hosts joined by a slow link: the groups the rank grid puts across hosts, and only those,
communicate at the link's rate (gloo's own per-message cost on top), as `hfmeg plan --gpus-per-node
--inter-node-gbps` times them. The step times of shaped runs on the namespace bed against these
predictions are measured by tools/check_plan_hosts.py (figures in docs/multihost.md): on the shared
2-core machine they move too much between runs to be a test."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from transformers import LlamaConfig

from hfmeg.families import model_config_from_hf
from hfmeg.optim.config import OptimizerConfig
from hfmeg.plan.auto import cpu_cluster
from hfmeg.plan.cli import main as plan
from hfmeg.plan.layout import PlanLayout
from hfmeg.plan.memory import stage_memory
from hfmeg.plan.profile import Profile
from hfmeg.plan.step_time import crossing_kinds, step_time

GLOO = (4, 1e9, 1e-4)  # (ranks on the machine, bytes/s, latency) of the profile's gloo link
CPU = Profile("cpu x2", 1e11, ((1e5, 0.5), (1e8, 1.0)), 0.3, 1e10, 1e-3, 5e-4, 5e-5, 1.0, links=(GLOO,), cores=2)
HF = LlamaConfig(hidden_size=256, intermediate_size=640, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=4, vocab_size=512, max_position_embeddings=128)
LLAMA = model_config_from_hf(HF)
SEQ, BATCH = 64, 4
LINK = 1e9 / 8  # 1 Gbit/s, one direction, per host
NET_LATENCY = 10e-6  # ClusterSpec's default between nodes
ONE_BUCKET = OptimizerConfig(bucket_size=10**9)


def _time(lay: PlanLayout, per_host: int):
    cluster = cpu_cluster(CPU, lay.gpus, per_host, inter_node_bytes_per_s=LINK)
    return step_time(LLAMA, lay, cluster, CPU, BATCH, SEQ, 4, ONE_BUCKET)


def _ring_rs_ag(elements: int, bw: float, latency: float) -> float:
    """A reduce-scatter of fp32 gradients and an all-gather of fp32 parameters over two ranks, in series."""
    return 2 * (0.5 * 4 * elements / bw + latency)


@pytest.mark.parametrize("lay, per_host, hosts_share", [
    (PlanLayout(2, 1, 2, 1), 2, 2),  # TP2 inside a host, DP2 across: a host's two DP rings share its link
    (PlanLayout(1, 2, 2, 1), 1, 1),  # PP2 x DP2 on 4 hosts x 1: each rank has its host's link
], ids=["tp2-dp2_2x2", "pp2-dp2_4x1"])
def test_the_dp_reduction_crosses_the_host_link_as_the_grid_says(lay, per_host, hosts_share):
    one, many = _time(lay, lay.gpus), _time(lay, per_host)
    grid = replace(lay.grid, per_host=per_host)
    assert crossing_kinds(lay, cpu_cluster(CPU, lay.gpus, per_host)) == set(grid.crossing()) | {"world"}
    assert "dp" in grid.crossing() and "tp" not in grid.crossing()
    # the stage with the most parameters (and so the longest reduction and update)
    mem = max((stage_memory(LLAMA, lay, r, BATCH, SEQ, 4, ONE_BUCKET) for r in range(lay.pp)),
              key=lambda m: m.param_buffer)
    gloo_bw, gloo_lat = GLOO[1:]
    # then, inside the host, the SP norms' gradients all-reduced over TP
    tp_sum = 2 * (0.5 * 4 * mem.tp_summed / gloo_bw + gloo_lat) if lay.tp > 1 else 0.0
    assert one.dp_exposed_s == pytest.approx(_ring_rs_ag(mem.param_buffer // 4, gloo_bw, gloo_lat) + tp_sum)
    # across hosts the ring moves at the host link's share (the slower) and pays both latencies
    assert many.dp_exposed_s == pytest.approx(
        _ring_rs_ag(mem.param_buffer // 4, LINK / hosts_share, gloo_lat + NET_LATENCY) + tp_sum)
    assert many.dp_exposed_s > 5 * one.dp_exposed_s
    assert many.tp_comm_s == one.tp_comm_s and many.compute_s == one.compute_s  # TP stays on the host's gloo
    if lay.pp > 1:  # the stage boundary crosses too: each micro-batch's activation and gradient at the link's rate
        message, m = SEQ * HF.hidden_size * 4, lay.microbatches(BATCH)
        assert one.p2p_s == pytest.approx(m * 2 * (message / gloo_bw + gloo_lat))
        assert many.p2p_s == pytest.approx(m * 2 * (message / LINK + gloo_lat + NET_LATENCY))


def test_hfmeg_plan_times_a_cpu_profile_over_the_host_link(tmp_path, capsys):
    """`hfmeg plan --profile cpu.json --gpus-per-node 2 --inter-node-gbps 1`: the gloo ranks of a CPU profile on
    hosts of two, as `cpu_cluster` places them."""
    HF.save_pretrained(tmp_path)
    CPU.save(tmp_path / "cpu.json")
    argv = ["--model", str(tmp_path), "--profile", str(tmp_path / "cpu.json"), "--gpus", "4", "--global-batch-size",
            str(BATCH), "--seq-len", str(SEQ), "--dtype", "fp32", "--tp", "2", "--json"]
    times = {}
    for per_host in (4, 2):
        assert plan([*argv, "--gpus-per-node", str(per_host), "--inter-node-gbps", "1"]) == 0
        times[per_host] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    lay = PlanLayout(2, 1, 2, 1)
    expected = step_time(LLAMA, lay, cpu_cluster(CPU, 4, 2, inter_node_bytes_per_s=LINK), CPU, BATCH, SEQ, 4)
    assert times[2]["time"]["dp_exposed_s"] == pytest.approx(expected.dp_exposed_s)
    assert times[2]["step_s"] == pytest.approx(expected.step_s)
    assert times[2]["step_s"] > times[4]["step_s"]
