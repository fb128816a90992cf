"""The FLOPs formula reduces to the Megatron-LM paper's closed form for a GPT."""

from hfmeg.config import ModelConfig
from hfmeg.plan.flops import mfu, training_flops


def _gpt(h=4096, layers=32, vocab=51200):
    return ModelConfig("gpt2", h, 4 * h, layers, 32, 32, h // 32, vocab, 2048, "layer", 1e-5, "gelu", False,
                       "learned", True, True, True, True)


def test_matches_paper_formula():
    b, s, l, h, v = 4, 2048, 32, 4096, 51200
    paper = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert abs(training_flops(_gpt(h, l, v), b, s) / paper - 1) < 1e-12


def test_mfu_is_tokens_times_flops_per_token_over_peak():
    cfg = _gpt()
    per_token = training_flops(cfg, 1, 2048) / 2048
    assert abs(mfu(cfg, 1000.0, 2048, 1e15, 2) - 1000.0 * per_token / 2e15) < 1e-15


def test_moe_layers_count_the_router_and_the_routed_experts_only():
    """Mixtral-8x7B's shapes: a token goes through the router and 2 of the 8 experts, about 13B of 47B parameters."""
    from transformers import MixtralConfig

    from hfmeg.families import model_config_from_hf

    cfg = model_config_from_hf(MixtralConfig())  # 4096 hidden, 14336 expert FFN, 8 experts, top-2, 32 layers
    h, f, s = 4096, 14336, 4096
    attention = h * (32 + 2 * 8) * 128 + 32 * 128 * h
    active = 32 * (attention + h * 8 + 2 * 3 * h * f) + h * cfg.vocab_size
    expect = 6 * s * active + 12 * s * s * 32 * 32 * 128
    assert training_flops(cfg, 1, s) == expect
    assert 12.5e9 < active + h * cfg.vocab_size < 13.5e9  # the published ~12.9B active parameters


def test_gpt_oss_counts_its_routed_experts_matmuls_and_not_its_biases_or_sinks():
    """gpt-oss-120b's shapes (transformers' default config): the router and 4 of 128 experts of 3·h·F each (gate_up
    `[h, 2F]`, down `[F, h]`); its biases, sinks and clamped SwiGLU are elementwise, which Megatron's accounting
    leaves out as it does every bias. The published 5.13B active parameters (the unembedding counted)."""
    from transformers import GptOssConfig

    from hfmeg.families import model_config_from_hf
    from hfmeg.plan.flops import layer_matmul_params

    cfg = model_config_from_hf(GptOssConfig())  # 2880 hidden and expert FFN, 64 heads of 64, 8 KV heads, 36 layers
    h = f = 2880
    attention = h * (64 + 2 * 8) * 64 + 64 * 64 * h
    assert layer_matmul_params(cfg, 0) == attention + h * 128 + 4 * 3 * h * f
    active = 36 * layer_matmul_params(cfg, 0) + h * cfg.vocab_size
    assert 5.08e9 < active < 5.18e9


def test_windowed_layers_count_the_pairs_their_window_computes():
    """A windowed layer's attention term is Megatron's scaled by its (query, key) pairs over the causal ones,
    counted here one query at a time; a full layer (and a window no shorter than the row) keeps Megatron's."""
    from dataclasses import replace

    s, w, l, h = 512, 100, 4, 4096
    cfg = replace(_gpt(h, l), sliding_window=w, full_attention_layers=(1, 3))
    causal, windowed = s * (s + 1) / 2, sum(min(i + 1, w) for i in range(s))
    per_layer = 12 * s * s * h
    full = training_flops(_gpt(h, l), 1, s)
    assert abs(training_flops(cfg, 1, s) - (full - 2 * per_layer * (1 - windowed / causal))) < 1e-6 * full
    assert training_flops(replace(cfg, sliding_window=s), 1, s) == full


def test_linear_attention_layers_have_no_quadratic_term():
    """Qwen3.5 (24 Gated DeltaNet layers, 8 gated attention ones): doubling the row doubles every term but the full
    layers' s^2 attention; the delta rule costs 3 x 2 (2 C dk + C (dk + dv) / 2 + C dv + 3 dk dv) per value head and
    token (C = 64), and the convolution 3 x 2 K per channel."""
    from transformers import Qwen3_5TextConfig

    from hfmeg.families import model_config_from_hf
    from hfmeg.plan.flops import delta_rule_flops

    cfg = model_config_from_hf(Qwen3_5TextConfig())
    la, s = cfg.linear_attention, 4096
    n_full = cfg.num_layers - len(la.layers)
    assert (len(la.layers), n_full) == (24, 8)

    def quadratic(n):
        return 12 * n * n * n_full * cfg.num_heads * cfg.head_dim
    growth = training_flops(cfg, 1, 2 * s) - 2 * training_flops(cfg, 1, s)
    assert abs(growth - (quadratic(2 * s) - 2 * quadratic(s))) < 1e-9 * growth
    rule = 2 * (2 * 64 * 128 + 64 * 256 / 2 + 64 * 128 + 3 * 128 * 128) * 32
    assert delta_rule_flops(cfg, s) == 3 * (rule + 2 * 4 * (2 * 16 * 128 + 32 * 128))


def test_linear_and_full_attention_layers_are_timed_each_as_its_kind():
    """Qwen3.5 mixes Gated DeltaNet and full-attention layers: the step time sums each layer at its own kind's cost,
    so replacing one of four linear layers by a full one moves the step by a quarter of the all-full difference."""
    from hfmeg.families import model_config_from_hf
    from hfmeg.plan.hardware import ClusterSpec, gpu_spec
    from hfmeg.plan.layout import PlanLayout
    from hfmeg.plan.profile import default_profile
    from hfmeg.plan.step_time import step_time
    from tiny_models import tiny_config

    spec = gpu_spec("h100")
    cluster, prof = ClusterSpec(spec, 1, 1), default_profile("h100", spec.peak_flops, spec.hbm_bytes_per_s)
    lay = PlanLayout(1, 1, 1, 1)

    def compute(types):
        return step_time(model_config_from_hf(tiny_config("qwen3_5", layer_types=types)), lay, cluster, prof, 4,
                         16384).compute_s  # long rows: attention's s² makes the kinds' costs differ

    linear, full = compute(["linear_attention"] * 4), compute(["full_attention"] * 4)
    assert abs(full - linear) > 0.1 * linear
    mixed = compute(["linear_attention"] * 3 + ["full_attention"])
    assert abs((mixed - linear) - (full - linear) / 4) <= 1e-9 * full
