"""Family specs (`hfmeg/families`): what a family's config reader decides that no round trip shows.

Qwen3's sliding window is per layer (`layer_types`): a window on every layer is Mistral's (kept, rows
longer than it refused at start-up), a window on some layers only is refused in one line naming the field."""

from __future__ import annotations

import pytest
from tiny_models import tiny_config

from hfmeg.errors import UnsupportedConfigError
from hfmeg.families import family_of, model_config_from_hf


def test_qwen3_features():
    cfg = model_config_from_hf(tiny_config("qwen3"))
    assert (cfg.qk_norm, cfg.head_dim, cfg.qkv_bias, cfg.out_bias, cfg.sliding_window) == (True, 16, False, False, None)
    assert model_config_from_hf(tiny_config("qwen3", attention_bias=True)).out_bias


def test_qwen3_window_on_every_layer_is_kept():
    hf = tiny_config("qwen3", sliding_window=32, layer_types=["sliding_attention"] * 2)
    assert model_config_from_hf(hf).sliding_window == 32


@pytest.mark.parametrize("layer_types, match", [
    (["full_attention", "sliding_attention"], r"layer_types: a sliding window on layers \[1\] only"),
    (["full_attention", "chunked_attention"], r"layer_types: \['chunked_attention'\] are not supported"),
])
def test_qwen3_per_layer_windows_refused(layer_types, match):
    with pytest.raises(UnsupportedConfigError, match=match):
        model_config_from_hf(tiny_config("qwen3", sliding_window=32, layer_types=layer_types))


def test_unknown_model_type_is_one_line_naming_the_field():
    with pytest.raises(UnsupportedConfigError, match=r"^config.json field model_type: 'falcon' is not supported "
                                                     r"\(supported: llama, mistral, qwen2, qwen3, [^\n]*\)$"):
        family_of("falcon")
