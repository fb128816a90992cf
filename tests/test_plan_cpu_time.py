"""The planner's step time for gloo ranks on a CPU host (what `tools/check_plan.py` measures): ranks that
outnumber the cores share them, links are those measured with as many ranks, every gradient bucket's collective
pays its latencies, an MoE layer's fixed cost grows with its experts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from transformers import LlamaConfig, MixtralConfig

from hfmeg.families import model_config_from_hf
from hfmeg.optim.config import OptimizerConfig
from hfmeg.plan.hardware import ClusterSpec, GpuSpec
from hfmeg.plan.layout import PlanLayout
from hfmeg.plan.memory import stage_memory
from hfmeg.plan.profile import Profile, load_profile
from hfmeg.plan.step_time import step_time

CPU = Profile("cpu x2", 1e11, ((1e5, 0.5), (1e8, 1.0)), 0.3, 1e10, 1e-3, 5e-4, 5e-5, 1.0,
              links=((2, 1e9, 1e-4), (8, 2e8, 2e-3)), cores=2, moe_layer_overhead_s=1e-3, expert_overhead_s=2e-4)
LLAMA = model_config_from_hf(LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                         num_attention_heads=8, num_key_value_heads=4, vocab_size=300,
                                         max_position_embeddings=128))
MIXTRAL = model_config_from_hf(MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                             num_attention_heads=8, num_key_value_heads=4, vocab_size=300,
                                             max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2))
SEQ = 32


def _time(cfg, lay: PlanLayout, prof: Profile = CPU, bucket_size: int = 5000, microbatches: int = 2):
    cluster = ClusterSpec(GpuSpec("cpu", prof.peak_flops, float("inf"), prof.memory_bytes_per_s, 1e9), lay.gpus,
                          lay.gpus, reserved_bytes=0)
    opt = OptimizerConfig(mode=lay.optimizer, bucket_size=bucket_size)
    return step_time(cfg, lay, cluster, prof, lay.dp * lay.micro_batch * microbatches, SEQ, 4, opt)


def test_links_by_ranks_on_the_host():
    assert CPU.link(1) == (1e9, 1e-4) and CPU.link(4) == (1e9, 1e-4) and CPU.link(8) == (2e8, 2e-3)
    assert CPU.link(64) == (2e8, 2e-3)
    assert replace(CPU, links=()).link(2) is None


def test_ranks_beyond_the_cores_share_them():
    """PP 4 on two cores computes at half the rate it would with a core per rank; PP 2 has its cores."""
    pp2, pp4 = PlanLayout(1, 2, 1, 1), PlanLayout(1, 4, 1, 1)
    assert _time(LLAMA, pp4).compute_s == pytest.approx(2 * _time(LLAMA, pp4, replace(CPU, cores=4)).compute_s)
    assert _time(LLAMA, pp2).compute_s == pytest.approx(_time(LLAMA, pp2, replace(CPU, cores=4)).compute_s)


def test_measured_slowdown_of_shared_cores():
    """Measured for 2 and 4 ranks on 2 cores: used as measured; 3 ranks as 2 taking turns 1.5 times over,
    16 as 4 four times over."""
    prof = replace(CPU, slowdown=((2, 1.5), (4, 3.2)))
    assert [prof.compute_slowdown(n) for n in (1, 2, 3, 4, 16)] == [1.0, 1.5, 2.25, 3.2, 12.8]
    assert [CPU.compute_slowdown(n) for n in (1, 2, 4)] == [1.0, 1.0, 2.0]
    pp4 = PlanLayout(1, 4, 1, 1)
    assert _time(LLAMA, pp4, prof).compute_s == pytest.approx(1.6 * _time(LLAMA, pp4).compute_s)


def test_tp_collectives_use_the_link_of_the_world():
    """TP 2 beside DP 4 (8 ranks) communicates at the 8-rank link: as TP 2 alone would over that link."""
    crowded = _time(LLAMA, PlanLayout(2, 1, 4, 2)).tp_comm_s
    over_8_rank_link = replace(CPU, links=((2, 2e8, 2e-3),))
    assert crowded == pytest.approx(_time(LLAMA, PlanLayout(2, 1, 1, 2), over_8_rank_link).tp_comm_s)
    assert crowded > 2 * _time(LLAMA, PlanLayout(2, 1, 1, 2)).tp_comm_s


def test_each_bucket_pays_its_latency_on_gloo():
    """`distributed` DP 2: reduce-scatter and all-gather of every bucket in series, each a latency."""
    lay = PlanLayout(1, 1, 2, 2, optimizer="distributed")
    small, large = _time(LLAMA, lay, bucket_size=2000), _time(LLAMA, lay, bucket_size=10**9)
    buckets = [stage_memory(LLAMA, lay, 0, 8, SEQ, 4, OptimizerConfig(mode="distributed", bucket_size=b)).buckets
               for b in (2000, 10**9)]
    assert buckets[1] == 1 and buckets[0] > 10
    latency = CPU.link(2)[1]
    assert small.dp_exposed_s - large.dp_exposed_s == pytest.approx(2 * (buckets[0] - 1) * latency, rel=0.05)


def test_sequence_parallel_collectives_at_their_measured_cost():
    """All but the loss's two all-reduces (of its statistics, with or without SP) cost the factor more."""
    sp = PlanLayout(2, 1, 1, 2)
    ratio = _time(LLAMA, sp, replace(CPU, sequence_parallel_comm=1.4)).tp_comm_s / _time(LLAMA, sp).tp_comm_s
    assert 1.3 < ratio < 1.4
    no_sp = PlanLayout(2, 1, 1, 2, sequence_parallel=False)
    assert _time(LLAMA, no_sp, replace(CPU, sequence_parallel_comm=1.4)).tp_comm_s == _time(LLAMA, no_sp).tp_comm_s


def test_gloo_hides_no_dp_collective():
    overlapped, distributed = (_time(LLAMA, PlanLayout(1, 1, 2, 2, optimizer=mode)) for mode in ("overlapped",
                                                                                              "distributed"))
    assert overlapped.dp_exposed_s == distributed.dp_exposed_s > 0


def test_recompute_fixed_costs():
    """Selective adds its fraction of each layer's fixed cost to the backward; full re-runs the forward at its own."""
    lay = lambda mode: PlanLayout(1, 1, 1, 2, recompute=mode)  # noqa: E731
    prof = replace(CPU, selective_recompute_fixed=0.5, full_recompute_fixed=1.5)
    none, selective, full = (_time(LLAMA, lay(m), prof).compute_s for m in ("none", "selective", "full"))
    layers = LLAMA.num_layers * 2  # micro-batches
    flat = replace(prof, selective_recompute_fixed=0.0, full_recompute_fixed=0.0)
    fixed = layers * CPU.layer_overhead_s
    assert selective - _time(LLAMA, lay("selective"), flat).compute_s == pytest.approx(0.5 * fixed)
    assert full - _time(LLAMA, lay("full"), flat).compute_s == pytest.approx(1.5 * fixed)
    assert none < selective < full


def test_moe_layer_fixed_cost_grows_with_its_experts():
    base = replace(CPU, moe_layer_overhead_s=None)
    ep1, ep2 = PlanLayout(1, 1, 2, 2), PlanLayout(1, 1, 2, 2, ep=2)
    layers = MIXTRAL.num_layers * 2  # micro-batches
    dense_cost = layers * CPU.layer_overhead_s
    assert _time(MIXTRAL, ep1).compute_s - _time(MIXTRAL, ep1, base).compute_s == pytest.approx(
        layers * (CPU.moe_layer_overhead_s + 4 * CPU.expert_overhead_s) - dense_cost)
    assert _time(MIXTRAL, ep2).compute_s - _time(MIXTRAL, ep2, base).compute_s == pytest.approx(
        layers * (CPU.moe_layer_overhead_s + 2 * CPU.expert_overhead_s) - dense_cost)


def test_a_profile_from_before_links_loads_with_its_two_rank_link(tmp_path):
    old = {k: v for k, v in json.loads(json.dumps(CPU.__dict__)).items()
           if k not in ("links", "moe_layer_overhead_s", "expert_overhead_s")}
    (tmp_path / "old.json").write_text(json.dumps({**old, "link_bytes_per_s": 7e8, "link_latency_s": 3e-4}))
    prof = load_profile(tmp_path / "old.json")
    assert prof.links == ((2, 7e8, 3e-4),) and prof.link(8) == (7e8, 3e-4) and prof.moe_layer_overhead_s is None


def test_executor_fixed_costs():
    """Per micro-batch and chunk on the slowest stage (PP 2 interleaved: two chunks a rank), and once a step."""
    lay = PlanLayout(1, 2, 1, 1, vpp=2)
    base, extra = _time(LLAMA, lay), _time(LLAMA, lay, replace(CPU, microbatch_overhead_s=1e-3, step_overhead_s=5e-3))
    m = 2  # micro-batches
    assert extra.compute_s - base.compute_s == pytest.approx(m * 2 * 1e-3)
    assert extra.step_s - base.step_s > m * 2 * 1e-3 + 5e-3


def _count_tp_all_reduces(cfg, microbatches: int) -> tuple[int, int]:
    """(all-reduces, their bytes) a TP 2 rank makes over its TP group in one step of the pipeline executor
    (every layer, the embedding, the LM head and the loss), counted on the real model."""
    import torch
    import torch.distributed as dist

    from hfmeg.data.microbatch import MicroBatch
    from hfmeg.models.decoder import ModelChunk
    from hfmeg.parallel.pipeline import forward_backward
    from hfmeg.parallel.state import ParallelConfig, ParallelState

    ps = ParallelState(ParallelConfig(tp=2), dist.get_rank(), 2, torch.device("cpu"))
    chunk = ModelChunk(cfg, ps, range(cfg.num_layers), pre_process=True, post_process=True)
    ids = torch.randint(0, cfg.vocab_size, (1, SEQ))
    calls, all_reduce = [], dist.all_reduce

    def counted(t, *a, group=None, **k):
        if group is ps.tp_group:
            calls.append(t.numel() * t.element_size())
        return all_reduce(t, *a, group=group, **k)

    dist.all_reduce = counted
    try:
        forward_backward([chunk], ps, [MicroBatch(input_ids=ids, labels=ids)] * microbatches, schedule="1f1b",
                         num_tokens=microbatches * SEQ, sync_loss=False)
    finally:
        dist.all_reduce = all_reduce
    return len(calls), sum(calls)


def test_gloo_tp_collectives_are_the_ones_the_model_makes():
    """SP off, TP 2: with an unbounded link the communication is two latencies (a message each way) per
    all-reduce, with no latency the all-reduced bytes over the bus rate; both as a real TP 2 step makes them
    over its TP group, ends and loss included."""
    from hfmeg.parallel.launch import spawn

    latency, rate = 1e-3, 1e9
    lay = PlanLayout(2, 1, 1, 1, sequence_parallel=False)
    by_latency = _time(LLAMA, lay, replace(CPU, links=((2, float("inf"), latency),)), microbatches=2).tp_comm_s
    by_bytes = _time(LLAMA, lay, replace(CPU, links=((2, rate, 0.0),)), microbatches=2).tp_comm_s
    (calls, nbytes), other = spawn(_count_tp_all_reduces, 2, LLAMA, 2)
    assert other == (calls, nbytes) and calls == 2 * (4 * LLAMA.num_layers + 4)
    assert by_latency == pytest.approx(calls * 2 * latency, rel=1e-12)
    assert by_bytes == pytest.approx(nbytes / rate, rel=1e-12)
