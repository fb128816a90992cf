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
