"""The planner's memory model against what the runtime allocates: the saved-tensor meter's peak plus
the optimizer's buffers and state, on forked gloo ranks (tools/check_plan.py runs the 23-layout grid). The ranks
run on the CPU, so the model counts the CPU path's attention (`dense_mask`: dense window masks, explicit soft-capped
scores)."""

from __future__ import annotations

import random

from dataclasses import replace

from transformers import GPT2Config, LlamaConfig, MistralConfig, MixtralConfig, Qwen2MoeConfig

from hfmeg.families import model_config_from_hf
from hfmeg.optim.config import OptimizerConfig
from hfmeg.plan.layout import PlanLayout
from hfmeg.plan.measure import Case, measure_cases
from hfmeg.plan.memory import _simulated_peak, stage_memory

SEQ = 32


def _llama(layers: int, kv: int):
    return model_config_from_hf(LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=layers,
                                            num_attention_heads=8, num_key_value_heads=kv, vocab_size=300,
                                            max_position_embeddings=128))


def _check(cases):
    for case, per_rank in zip(cases, measure_cases(cases, steps=0)):
        opt = OptimizerConfig(mode=case.layout.optimizer, bucket_size=case.bucket_size)
        for r in per_rank:
            m = stage_memory(case.cfg, case.layout, r["pp_rank"], case.global_batch, SEQ, 4, opt, dense_mask=True)
            assert m.activations == r["activations"], (case.layout.name(), m.activations, r)
            assert m.param_buffer + m.grad_buffer == r["buffers"], (case.layout.name(), r)
            assert m.optimizer_state == r["optimizer_state"], (case.layout.name(), r)


def test_memory_model_matches_meter_and_optimizer_exactly():
    gpt2 = model_config_from_hf(GPT2Config(n_embd=64, n_layer=4, n_head=8, vocab_size=300, n_positions=128))
    _check([  # TP+SP with GQA and selective recompute; MHA (Q a view of QKV) on an uneven 3+2 PP split;
        # GPT-2 (tied embeddings, LayerNorm, no RoPE) on DP=2 with ddp and full recompute
        Case(_llama(4, 4), PlanLayout(2, 1, 1, 2, recompute="selective"), 2 * 2, SEQ, 5000),
        Case(_llama(5, 8), PlanLayout(1, 2, 1, 2), 2 * 4, SEQ, 5000),
        Case(gpt2, PlanLayout(1, 1, 2, 1, recompute="full", optimizer="ddp"), 2 * 2, SEQ, 5000),
        # the run's model.vocab_multiple (64 x TP 2: the head 384 rows, not 512): read by the planner as by the trainer
        Case(_llama(2, 4), PlanLayout(2, 1, 1, 1, vocab_multiple=64), 2, SEQ, 5000),
    ])


def test_memory_model_matches_meter_under_context_parallelism():
    """CP 2 as `plan measure` runs it (each rank half of every row, the DP x CP optimizer shards). One row per
    micro-batch: the model counts the CP mask per row, as packed rows need it; `plan measure`'s unpacked rows
    share one, so with more rows the meter would see less than the trainer keeps."""
    _check([Case(_llama(4, 4), PlanLayout(1, 1, 1, 1, cp=2), 2, SEQ, 5000)])


def test_windowed_and_soft_capped_attention_memory_matches_meter_exactly():
    """A window of 4 tokens on rows of 32 (Mistral's, on every layer): SDPA saves its additive copy of each layer's
    window mask; soft-capped scores (a LLaMA with `attn_softcap`, as Gemma 2's attention computes them): the
    explicit scores' tanh and probabilities instead of SDPA's output, with GQA (K and V repeated) and without (MHA),
    and with the window too; under selective recompute none of it is kept."""
    small = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
                 vocab_size=300, max_position_embeddings=128)
    windowed = model_config_from_hf(MistralConfig(**small, num_key_value_heads=4, sliding_window=4))
    capped = replace(_llama(3, 8), attn_softcap=0.5)
    _check([
        Case(windowed, PlanLayout(2, 1, 1, 1, sequence_parallel=False), 2, SEQ, 5000),
        Case(capped, PlanLayout(1, 2, 1, 1), 2 * 2, SEQ, 5000),
        Case(replace(windowed, attn_softcap=0.5), PlanLayout(2, 1, 1, 1), 2, SEQ, 5000),
        Case(replace(windowed, attn_softcap=0.5), PlanLayout(2, 1, 1, 1, recompute="selective"), 2, SEQ, 5000),
    ])
    assert stage_memory(windowed, PlanLayout(1, 1, 1, 1), 0, 1, SEQ, 4, dense_mask=True).activations - \
        stage_memory(windowed, PlanLayout(1, 1, 1, 1), 0, 1, SEQ, 4).activations == 2 * 4 * SEQ * SEQ  # 2 layers


def test_family_features_memory_matches_meter_exactly():
    """What the families switch on, as the meter sees it: Gemma 2's four (1 + w) norms, GeGLU, scaled embedding and
    capped scores under its windows; Gemma 4's w norms in fp32, value norm and two RoPE tables; Qwen3's QK-norm,
    SmolLM3's layers without RoPE, Phi-3's partial rotary; under SP, on two stages and with selective recompute."""
    from tiny_models import tiny_config

    layers = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    cfgs = {k: model_config_from_hf(tiny_config(k, **layers)) for k in ("gemma2", "gemma4")}
    cfgs |= {k: model_config_from_hf(tiny_config(k, num_hidden_layers=3, layer_types=["full_attention"] * 3))
             for k in ("qwen3", "phi3")}
    cfgs["smollm3"] = model_config_from_hf(tiny_config("smollm3"))
    _check([Case(cfg, lay, 2 * 2, SEQ, 5000) for cfg in cfgs.values()
            for lay in (PlanLayout(2, 1, 1, 2), PlanLayout(1, 2, 1, 2, recompute="selective"))])


def test_gpt_oss_memory_matches_meter_exactly():
    """gpt-oss's sinks in the explicit scores (with its window on layer 0, and with a cap too), its router bias (nothing
    saved), its experts' biases (an index per bias) and clamped SwiGLU; under TP + SP, on two stages with selective
    recompute; with its load-balancing loss on (what the loss saves on the last stage: 4·(2E + 1) bytes)."""
    from tiny_models import tiny_config

    cfg = model_config_from_hf(tiny_config("gpt_oss", hidden_size=64, num_attention_heads=8, num_key_value_heads=4,
                                           output_router_logits=True))
    assert cfg.adds_aux_loss
    _check([Case(cfg, PlanLayout(2, 1, 1, 2), 2 * 2, SEQ, 5000),
            Case(cfg, PlanLayout(1, 2, 1, 2, recompute="selective"), 2 * 2, SEQ, 5000),
            Case(replace(cfg, attn_softcap=0.5), PlanLayout(2, 1, 1, 1), 2, SEQ, 5000)])


def _moe_configs():
    """A 2-layer Mixtral with 4 experts, and a 3-layer Qwen2-MoE with a dense layer (decoder_sparse_step 2), a
    shared expert and top-k renormalisation."""
    small = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, vocab_size=300,
                 max_position_embeddings=128, num_experts_per_tok=2)
    mixtral = model_config_from_hf(MixtralConfig(**small, intermediate_size=96, num_hidden_layers=2,
                                                 num_local_experts=4))
    qwen = model_config_from_hf(Qwen2MoeConfig(**small, intermediate_size=96, moe_intermediate_size=48,
                                               shared_expert_intermediate_size=80, num_hidden_layers=3,
                                               num_experts=4, decoder_sparse_step=2, norm_topk_prob=True))
    return mixtral, qwen


def test_moe_memory_matches_meter_exactly():
    """Mixtral (fp32 combine) with TP splitting the tokens, not the experts; Qwen2-MoE with a dense layer
    (decoder_sparse_step 2), a shared expert and top-k renormalisation, under SP and on two stages."""
    mixtral, qwen = _moe_configs()
    _check([
        Case(mixtral, PlanLayout(2, 1, 1, 2, sequence_parallel=False, recompute="selective"), 2, SEQ, 5000),
        Case(qwen, PlanLayout(2, 1, 1, 2), 2, SEQ, 5000),
        Case(qwen, PlanLayout(1, 2, 1, 1), 4, SEQ, 5000),
    ])


def test_expert_parallel_memory_matches_within_routing_imbalance():
    """EP 2: each rank holds half the experts, whose buffers are sharded over expert-DP (DP/EP), exactly.
    Activations scale with the rows a rank receives, which a random router spreads unevenly: each rank within
    5 % of the balanced prediction (the test's bound for the whole), and an EP group's ranks together exactly
    EP times it (routing moves rows between ranks, it does not add any) where a rank's peak holds every
    micro-batch of the step (one micro-batch, or all in flight on the first of two stages)."""
    mixtral, qwen = _moe_configs()
    cases = {2: [Case(mixtral, PlanLayout(1, 1, 2, 2, ep=2), 4, SEQ, 5000),
                 Case(mixtral, PlanLayout(1, 1, 2, 2, ep=2, recompute="full", optimizer="ddp"), 4, SEQ, 5000)],
             4: [Case(mixtral, PlanLayout(2, 1, 2, 2, ep=2, recompute="selective"), 4, SEQ, 5000),
                 Case(qwen, PlanLayout(1, 2, 2, 1, ep=2), 4, SEQ, 5000),
                 Case(qwen, PlanLayout(1, 1, 4, 1, ep=2, optimizer="distributed"), 4, SEQ, 5000)]}
    for group in cases.values():
        for case, per_rank in zip(group, measure_cases(group, steps=0)):
            lay, name = case.layout, case.layout.name()
            opt = OptimizerConfig(mode=lay.optimizer, bucket_size=case.bucket_size)
            ep_groups = {}
            for rank, r in enumerate(per_rank):
                m = stage_memory(case.cfg, lay, r["pp_rank"], case.global_batch, SEQ, 4, opt)
                assert m.param_buffer + m.grad_buffer == r["buffers"], (name, r)
                assert m.optimizer_state == r["optimizer_state"], (name, r)
                assert abs(m.measurable / r["bytes"] - 1) <= 0.05, (name, r)
                dp_rank = (rank // lay.tp) % lay.dp  # the rank grid of parallel/state.py
                ep_groups.setdefault((rank % lay.tp, rank // (lay.tp * lay.dp), dp_rank // lay.ep), []).append(
                    (r["activations"], m.activations))
            for members in ep_groups.values():
                assert sum(a for a, _ in members) == sum(b for _, b in members), (name, members)


def test_in_flight_peak_is_the_schedules_and_a_short_plan_gives_the_same():
    # 1F1B keeps pp - r micro-batches on stage r, whatever m >= pp.
    assert [_simulated_peak("1f1b", 4, r, 1, 16, (10,)) for r in range(4)] == [40, 30, 20, 10]
    rng = random.Random(0)
    for _ in range(200):  # the model simulates at most 4·pp micro-batches; longer plans peak the same
        pp, vpp = rng.choice([2, 3, 4]), rng.choice([1, 2, 4])
        schedule = "interleaved" if vpp > 1 else "1f1b"
        m = pp * rng.randint(4, 10)
        sizes = tuple(rng.randint(1, 999) for _ in range(vpp))
        r = rng.randrange(pp)
        assert _simulated_peak(schedule, pp, r, vpp, m, sizes) == _simulated_peak(schedule, pp, r, vpp, 4 * pp, sizes)


def test_gpipe_keeps_every_microbatch_and_dp_shards_optimizer_state():
    cfg = _llama(4, 4)
    one = stage_memory(cfg, PlanLayout(1, 2, 1, 1, schedule="gpipe"), 0, 8, SEQ, 4)
    f1b = stage_memory(cfg, PlanLayout(1, 2, 1, 1), 0, 8, SEQ, 4)
    assert one.activations == 8 * f1b.activations // 2  # 8 in flight vs pp - 0 = 2
    dp1 = stage_memory(cfg, PlanLayout(1, 1, 1, 1), 0, 8, SEQ, 2)
    dp4 = stage_memory(cfg, PlanLayout(1, 1, 4, 1), 0, 8, SEQ, 2)
    assert dp4.optimizer_state * 4 == dp1.optimizer_state + 12 * (dp4.grad_buffer - dp1.grad_buffer) // 4


def test_deepseek_v3_memory_matches_meter_exactly():
    """DeepSeek-V3's latent attention (values narrower than queries and keys, so the CPU's SDPA takes its math path;
    with and without a query latent), its grouped sigmoid routing and ungated shared expert, and the all-dense
    variant; under TP + SP, without SP, on two stages with selective recompute, and selective under SP (the
    gathered rotated key kept)."""
    from tiny_models import tiny_config

    moe = model_config_from_hf(tiny_config("deepseek_v3"))
    dense = model_config_from_hf(tiny_config("deepseek_v3", first_k_dense_replace=3))
    no_q_latent = model_config_from_hf(tiny_config("deepseek_v3", q_lora_rank=None))
    assert dense.moe is None and moe.moe is not None
    _check([Case(moe, PlanLayout(2, 1, 1, 2), 2 * 2, SEQ, 5000),
            Case(moe, PlanLayout(1, 2, 1, 2, recompute="selective"), 2 * 2, SEQ, 5000),
            Case(moe, PlanLayout(2, 1, 1, 2, recompute="selective"), 2 * 2, SEQ, 5000),
            Case(dense, PlanLayout(2, 1, 1, 2, sequence_parallel=False), 2 * 2, SEQ, 5000),
            Case(no_q_latent, PlanLayout(2, 1, 1, 1), 2, SEQ, 5000)])
