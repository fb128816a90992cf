"""Family specs (`hfmeg/families`): what a family's config reader decides that no round trip shows.

Sliding windows (Mistral's and Phi-3's on every layer, Qwen3's and SmolLM3's per `layer_types`) against
transformers on rows and packed documents longer than the window; an unknown layer type is refused in one
line naming the field. A Gemma 3 trainer run at TP2 x CP2 on rows longer than its window. SmolLM3's NoPE layers, Phi-3's partial rotary and LongRoPE tables against transformers', and
Phi-3's LoRA on its fused projections (logits, gradients and round trips are in the parametrised parity tests)."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import reference_attention, save_tiny, tiny_config
from transformers import AutoModelForCausalLM, Phi3Config, SmolLM3Config

from bounds import assert_close, rounding_bound
from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.config import check_cp
from hfmeg.errors import UnsupportedConfigError
from hfmeg.families import family_of, model_config_from_hf
from hfmeg.models.kernels import rope
from hfmeg.models.rope import RotaryEmbedding


def test_qwen3_features():
    cfg = model_config_from_hf(tiny_config("qwen3"))
    assert (cfg.qk_norm, cfg.head_dim, cfg.qkv_bias, cfg.out_bias, cfg.sliding_window) == (True, 16, False, False, None)
    assert model_config_from_hf(tiny_config("qwen3", attention_bias=True)).out_bias


# A window of 6 tokens: shorter than the rows (24) and the packed documents (10 and 14 tokens).
WINDOWED = {
    "mistral": dict(sliding_window=6),
    "phi3": dict(sliding_window=6),
    "qwen2": dict(use_sliding_window=True, sliding_window=6, layer_types=["full_attention", "sliding_attention"]),
    "qwen3": dict(use_sliding_window=True, sliding_window=6, layer_types=["sliding_attention", "full_attention"]),
    "smollm3": dict(use_sliding_window=True, sliding_window=6, layer_types=["full_attention", "sliding_attention"]),
    "gemma2": dict(sliding_window=6),
    "gemma3": dict(sliding_window=6),
    "olmo3": dict(sliding_window=6),
}


@pytest.mark.parametrize("kind", WINDOWED)
def test_sliding_windows_match_transformers_on_rows_and_packed_documents(tmp_path, kind):
    """Whole rows against transformers' row; a packed row's documents each against transformers run on that
    document alone (transformers has no packing): the window and the document mask together."""
    folder = save_tiny(kind, tmp_path / "m", **WINDOWED[kind])
    chunk = load_chunks(HFCheckpoint(folder), make_ps(world=1))[0]
    windows = [chunk.cfg.window(i) for i in range(chunk.cfg.num_layers)]
    assert windows == [6, 6] if kind in ("mistral", "phi3") else 6 in windows and None in windows
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                               attn_implementation=reference_attention(folder))
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    lengths = (10, 14)
    seg = torch.repeat_interleave(torch.arange(1, 3), torch.tensor(lengths)).expand(2, -1)
    pos = torch.cat([torch.arange(n) for n in lengths]).expand(2, -1)
    exact = copy.deepcopy(ref).double()  # the float64 run each bound is derived from (bounds.rounding_bound)
    with torch.no_grad():
        want = ref(ids).logits
        assert_close(chunk(ids)[..., :300], want, rtol=0, atol=rounding_bound(want, exact(ids).logits))
        packed = chunk(ids, position_ids=pos, segment_ids=seg)[..., :300]
        for start, n in ((0, 10), (10, 14)):
            doc = ids[:, start:start + n]
            assert_close(packed[:, start:start + n], ref(doc).logits, rtol=0,
                         atol=rounding_bound(ref(doc).logits, exact(doc).logits))
        ref.config.sliding_window = 10**6  # the window changes the logits: the comparison above sees it
        assert (ref(ids, use_cache=False).logits - want).abs().max() > 1e-2


def test_unknown_layer_type_is_refused_naming_the_field():
    with pytest.raises(UnsupportedConfigError, match=r"^config.json field layer_types: \['chunked_attention'\] are "
                                                     r"not supported \(supported: full_attention, sliding_attention\)$"):
        model_config_from_hf(tiny_config("qwen3", sliding_window=32, layer_types=["full_attention",
                                                                                 "chunked_attention"]))


def test_olmo3_null_window_is_refused_naming_the_field():
    # Its layers pick their RoPE by their window: without one the sliding layers' RoPE would be lost.
    with pytest.raises(UnsupportedConfigError, match=r"^config.json field sliding_window: null: olmo3's sliding "
                                                     r"layers need a window$"):
        model_config_from_hf(tiny_config("olmo3", sliding_window=None))


def test_unknown_model_type_is_one_line_naming_the_field():
    with pytest.raises(UnsupportedConfigError, match=r"^config.json field model_type: 'falcon' is not supported "
                                                     r"\(supported: llama, mistral, qwen2, qwen3, [^\n]*\)$"):
        family_of("falcon")


def test_smollm3_nope_layers():
    assert model_config_from_hf(tiny_config("smollm3")).nope_layers == (1,)  # no_rope_layer_interval 2
    cfg = model_config_from_hf(tiny_config("smollm3", num_hidden_layers=8, no_rope_layers=[1, 1, 1, 0] * 2,
                                           use_sliding_window=False))
    assert (cfg.nope_layers, cfg.uses_rope(2), cfg.uses_rope(3), cfg.tie_embeddings) == ((3, 7), True, False, True)
    with pytest.raises(UnsupportedConfigError, match=r"^config.json field no_rope_layers: 3 entries for "):
        model_config_from_hf(tiny_config("smollm3", no_rope_layers=[1, 0, 1]))


def test_smollm3_window_is_on_the_nope_layers():
    """transformers puts SmolLM3's window on its NoPE layers; without use_sliding_window the window is unused."""
    hf = SmolLM3Config(**{k: getattr(tiny_config("smollm3"), k) for k in ("hidden_size", "num_hidden_layers")},
                       no_rope_layer_interval=2, use_sliding_window=True, sliding_window=32, pad_token_id=None)
    cfg = model_config_from_hf(hf)
    assert (cfg.nope_layers, cfg.window(0), cfg.window(1)) == ((1,), None, 32)
    hf.use_sliding_window = False
    assert model_config_from_hf(hf).sliding_window is None


def test_partial_rotary_is_phi3s_switch():
    cfg = model_config_from_hf(tiny_config("phi3"))
    assert (cfg.partial_rotary_factor, cfg.rotary_dim, cfg.num_kv_heads, cfg.nope_layers) == (0.75, 6, 4, ())
    with pytest.raises(UnsupportedConfigError, match=r"^config.json field partial_rotary_factor: partial rotary "
                                                     r"embeddings are not supported for llama$"):
        model_config_from_hf(tiny_config("llama_tied", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                        "partial_rotary_factor": 0.5}))


def test_partial_rope_rotates_the_first_dims_as_transformers():
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb
    q, k = torch.randn(2, 3, 5, 8), torch.randn(2, 1, 5, 8)
    cos, sin = torch.randn(2, 5, 6), torch.randn(2, 5, 6)
    for ours, ref in zip((rope(q, cos, sin), rope(k, cos, sin)), apply_rotary_pos_emb(q, k, cos, sin)):
        assert torch.equal(ours, ref)
    assert torch.equal(rope(q, cos, sin)[..., 6:], q[..., 6:])


def _longrope_config() -> Phi3Config:
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.5, 2.0], "long_factor": [3.0, 5.0, 9.0]}
    return Phi3Config(hidden_size=64, num_attention_heads=8, num_hidden_layers=2, vocab_size=300, pad_token_id=None,
                      max_position_embeddings=128, original_max_position_embeddings=16, rope_parameters=rope)


def test_longrope_tables_match_transformers_short_and_long():
    """Up to `original_max_position_embeddings` positions the short factors, past it the long ones, as
    transformers' Phi-3 rotary embedding switches (both scaled by the same attention factor)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    hf = _longrope_config()
    ours, ref = RotaryEmbedding(model_config_from_hf(hf)), Phi3RotaryEmbedding(hf)
    tables = {}
    for n in (16, 24, 8):
        pos = torch.arange(n)[None]
        tables[n] = ours(pos, torch.float32)
        for a, b in zip(tables[n], ref(torch.zeros(1), pos)):
            assert torch.equal(a, b), n
    assert not torch.equal(tables[24][0][:, :8], tables[8][0])  # the long set is in use past 16 positions


def test_longrope_is_refused_under_cp():
    with pytest.raises(UnsupportedConfigError, match=r"^config.json field rope_parameters.rope_type: 'longrope' "):
        check_cp(model_config_from_hf(_longrope_config()), 2)
    check_cp(model_config_from_hf(_longrope_config()), 1)


def test_gemma3_trains_at_tp2_cp2_on_rows_longer_than_its_window_and_exports(tmp_path):
    """5 steps of the trainer on packed alpaca rows of 64 tokens (window 4, soft-capped logits) at TP2 x CP2: the
    export has the source's tensors, trained, and loads in transformers' Gemma 3 class."""
    from safetensors.torch import load_file

    model = save_tiny("gemma3", tmp_path / "m", vocab_size=512)
    hf = train_5_steps(model, tmp_path / "out", tp=2, cp=2)
    before, after = load_file(model / "model.safetensors"), load_file(hf / "model.safetensors")
    assert sorted(before) == sorted(after)
    assert not torch.equal(before["model.layers.0.self_attn.q_norm.weight"],
                           after["model.layers.0.self_attn.q_norm.weight"])
    assert type(AutoModelForCausalLM.from_pretrained(hf)).__name__ == "Gemma3ForCausalLM"


def train_5_steps(model, out, *, tp: int, cp: int = 1):
    """5 trainer steps on packed alpaca rows of 64 tokens from the tiny `model` (given stories260K's tokenizer), on
    tp x cp ranks with one row each a step; checks the losses are finite and returns the exported HF folder."""
    import shutil

    from helpers import stories_or_skip
    from hfmeg.data import DataConfig, SourceConfig
    from hfmeg.optim.config import OptimizerConfig
    from hfmeg.optim.lr_schedule import LRScheduleConfig
    from hfmeg.parallel.launch import spawn
    from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
    from hfmeg.train.metrics import read_metrics
    from tiny_models import ASSETS

    stories, alpaca = stories_or_skip(), ASSETS / "data" / "alpaca_en_demo.json"
    if not alpaca.is_file():
        pytest.skip(f"{alpaca} is absent")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories / name, model / name)
    cfg = TrainConfig(model=ModelArgs(path=str(model), dtype="fp32"), parallel=ParallelArgs(tp=tp, cp=cp),
                      optim=OptimizerConfig(lr=1e-3, eps=1e-5), lr=LRScheduleConfig(warmup_steps=1, total_steps=5),
                      data=DataConfig(sources=[SourceConfig(str(alpaca))], seq_len=64),
                      train=LoopArgs(micro_batch_size=1, global_batch_size=tp * cp, max_steps=5, eval_every=0),
                      checkpoint=CheckpointArgs(out=str(out), save_every=0, keep_last=1), report_to=[])
    hf = spawn(_train, tp * cp, cfg)[0]
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 5 and all(torch.isfinite(torch.tensor(losses)))
    return hf


def _train(cfg):
    from hfmeg.train.trainer import Trainer

    return Trainer(cfg).run().hf_folder


@pytest.mark.parametrize("fields, message", [
    ({"num_kv_shared_layers": 1}, r"num_kv_shared_layers: layer 1 \(full_attention\) reuses keys and values, but no "
                                  r"layer before layer 1 is a full_attention layer to take them from"),
    ({"num_kv_shared_layers": 2}, r"num_kv_shared_layers: 2: between 1 and num_hidden_layers - 1 \(1\) layers"),
    ({"hidden_size_per_layer_input": 4, "vocab_size_per_layer_input": 100},
     r"vocab_size_per_layer_input: 100: hfmeg splits the per-layer table's rows over TP as the token embedding's")])
def test_gemma4_kv_sharing_and_per_layer_inputs_hfmeg_cannot_build_are_refused_naming_the_field(fields, message):
    """KV sharing and per-layer inputs are built (tests/test_gemma4_small_releases.py); what has no producing layer,
    shares every layer, or has a per-layer vocabulary of its own is refused."""
    with pytest.raises(UnsupportedConfigError, match=rf"^config.json field {message}"):
        model_config_from_hf(tiny_config("gemma4", **fields))


def test_gemma4_per_layer_shapes_off_the_full_layers_are_refused():
    """The full layers' own shape is built (tests/test_gemma4_releases.py); an override elsewhere is refused."""
    base = {k: v for k, v in tiny_config("gemma4").to_dict().items() if k != "per_layer_config"}
    sliding = type(tiny_config("gemma4"))(**{**base, "per_layer_config": {0: {"head_dim": 16}}})
    with pytest.raises(UnsupportedConfigError, match=r"^config.json field per_layer_config: layers \[0\] override the "
                                                     r"attention shape but are not full_attention layers"):
        model_config_from_hf(sliding)


def test_gemma4_refusals_at_conversion_and_start_up(tmp_path, capsys):
    """A config hfmeg cannot build (a layer sharing keys and values with no earlier layer of its type): the loader
    raises, the converter says one line and exits 2 with no output."""
    import json

    from tool_loader import load_tool

    folder = save_tiny("gemma4", tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_kv_shared_layers": 1}))
    with pytest.raises(UnsupportedConfigError, match=r"config.json field num_kv_shared_layers: layer 1 \(full"):
        load_chunks(HFCheckpoint(folder), make_ps(world=1))
    capsys.readouterr()
    rc = load_tool("convert_hf_to_mp").main(["--hf", str(folder), "--out", str(tmp_path / "mp"), "--tp", "1",
                                             "--pp", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "config.json field num_kv_shared_layers: layer 1" in err[0], err
    assert not (tmp_path / "mp").exists()
