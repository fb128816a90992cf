"""HF -> MP shards -> HF is bit-exact, resharding too, and the export loads in transformers.

Conversions run in-process (they are pure tensor moves); every tensor of the
source safetensors is compared byte for byte with the exported one.
"""

from __future__ import annotations

import json
import shutil
import socket
import time

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from convert_helpers import LAYOUTS, assert_same_tensors, make_sources
from helpers import make_ps, stories_or_skip
from hfmeg.checkpoint import hub_source
from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.load import load_chunks
from hfmeg.checkpoint.mp_layout import LATEST_FILE, MPLayout
from hfmeg.checkpoint.mp_reader import MPCheckpoint
from hfmeg.checkpoint.reshard import reshard_mp
from hfmeg.plan.models import resolve_model
from hfmeg.errors import CheckpointError, LayoutError, UnsupportedConfigError


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return make_sources(tmp_path_factory.mktemp("src"))


@pytest.mark.parametrize("kind", ["stories260K", "llama3", "mistral", "qwen2", "gpt2", "llama_tied", "qwen3", "smollm3",
                                  "phi3", "gemma2", "gemma3", "gemma4", "olmo2", "olmo3"])
def test_round_trip_bit_exact_all_layouts(kind, sources, tmp_path):
    if kind not in sources:
        stories_or_skip()
    src = sources[kind]
    for tp, pp in LAYOUTS:
        mp, hf = tmp_path / f"mp{tp}{pp}", tmp_path / f"hf{tp}{pp}"
        hf_to_mp(src, mp, tp=tp, pp=pp)
        layout = MPLayout.read(mp / "release")
        assert (layout.tp, layout.pp, len(list((mp / "release").glob("mp_rank_*")))) == (tp, pp, tp * pp)
        mp_to_hf(mp, hf)
        assert assert_same_tensors(src, hf) > 0, (tp, pp)
        shutil.rmtree(mp), shutil.rmtree(hf)


@pytest.mark.parametrize("kind", ["stories260K", "llama_tied", "gpt2"])
def test_reshard_tp2pp2_to_tp4pp1_bit_exact(kind, sources, tmp_path):
    if kind not in sources:
        stories_or_skip()
    src = sources[kind]
    hf_to_mp(src, tmp_path / "a", tp=2, pp=2)
    reshard_mp(tmp_path / "a", tmp_path / "b", tp=4, pp=1)
    assert MPLayout.read(tmp_path / "b" / "release").tp == 4
    mp_to_hf(tmp_path / "b", tmp_path / "hf")
    assert_same_tensors(src, tmp_path / "hf")


def test_vpp_layout_and_reshard_bit_exact(tmp_path):
    src = stories_or_skip()
    hf_to_mp(src, tmp_path / "v", tp=2, pp=2, vpp=2)
    layout = MPLayout.read(tmp_path / "v" / "release")
    # 5 layers in 4 chunks: 2+1+1+1; rank 0 holds model chunks 0 and 2, rank 1 chunks 1 and 3.
    assert [list(c.layers) for c in layout.chunks] == [[0, 1], [2], [3], [4]]
    assert [c.index for c in layout.rank_chunks(1)] == [1, 3]
    with safe_open(str(tmp_path / "v/release/mp_rank_01_001/model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "layers.2.attn.qkv.weight" in names and "layers.4.mlp.fc2.weight" in names and "lm_head.weight" in names
    assert not any(n.startswith(("layers.0.", "layers.3.", "embed")) for n in names)
    mp_to_hf(tmp_path / "v", tmp_path / "hf")
    assert_same_tensors(src, tmp_path / "hf")
    reshard_mp(tmp_path / "v", tmp_path / "u", tp=1, pp=3, pp_layers=[1, 3, 1])
    assert MPLayout.read(tmp_path / "u" / "release").pp_layers == [1, 3, 1]
    mp_to_hf(tmp_path / "u", tmp_path / "hf2")
    assert_same_tensors(src, tmp_path / "hf2")


def test_tied_embedding_stored_on_both_end_stages(sources, tmp_path):
    hf_to_mp(sources["llama_tied"], tmp_path / "mp", tp=2, pp=2)
    layout = MPLayout.read(tmp_path / "mp" / "release")
    assert layout.padded_vocab == 32256  # 32001 padded to a multiple of 128 x TP
    for t in range(2):
        with safe_open(str(tmp_path / f"mp/release/mp_rank_{t:02d}_000/model.safetensors"), "pt") as first, \
                safe_open(str(tmp_path / f"mp/release/mp_rank_{t:02d}_001/model.safetensors"), "pt") as last:
            assert torch.equal(first.get_tensor("embed.weight"), last.get_tensor("lm_head.weight"))


def test_export_loads_in_transformers_with_dtype_and_shards(tmp_path):
    src = stories_or_skip()
    hf_to_mp(src, tmp_path / "mp", tp=2, pp=1, dtype="bf16")
    assert MPLayout.read(tmp_path / "mp" / "release").dtype == "bfloat16"
    mp_to_hf(tmp_path / "mp", tmp_path / "hf", max_shard_size="200KB")
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    src_cfg, out_cfg = json.loads((src / "config.json").read_text()), json.loads((out / "config.json").read_text())
    assert set(out_cfg) >= set(src_cfg)
    assert {k: v for k, v in out_cfg.items() if k not in ("dtype", "torch_dtype")} == \
        {k: v for k, v in src_cfg.items() if k not in ("dtype", "torch_dtype")}
    assert out_cfg.get("dtype", out_cfg.get("torch_dtype")) == "bfloat16"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes(), name
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.dtype == torch.bfloat16
    ref = AutoModelForCausalLM.from_pretrained(src)
    for (n, p), (_, q) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(p, q.to(torch.bfloat16)), n
    assert AutoTokenizer.from_pretrained(out)("Hello")["input_ids"] == AutoTokenizer.from_pretrained(src)("Hello")["input_ids"]
    # A sharded (index + several files) bf16 source converts back bit-exact too, with --pp-layers.
    hf_to_mp(out, tmp_path / "mp2", tp=4, pp=2, pp_layers=[4, 1])
    mp_to_hf(tmp_path / "mp2", tmp_path / "hf2")
    assert_same_tensors(out, tmp_path / "hf2")


def test_bin_checkpoint_source(tmp_path):
    src = stories_or_skip()
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(src / "config.json", legacy / "config.json")
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        torch.save({k: f.get_tensor(k) for k in f.keys()}, legacy / "pytorch_model.bin")
    hf_to_mp(legacy, tmp_path / "mp", tp=2, pp=2)
    mp_to_hf(tmp_path / "mp", tmp_path / "hf")
    assert_same_tensors(src, tmp_path / "hf")


def test_hub_id_uses_snapshot_download_and_local_folder_bypasses_it(monkeypatch, tmp_path):
    src = stories_or_skip()
    calls = []

    def fake_download(repo_id, allow_patterns, local_files_only):
        calls.append((repo_id, allow_patterns))
        return str(src)

    monkeypatch.setattr(hub_source, "snapshot_download", fake_download)
    hf_to_mp("karpathy/stories260K", tmp_path / "mp", tp=1, pp=1)
    assert calls and calls[0][0] == "karpathy/stories260K" and "*.safetensors" in calls[0][1]

    def refuse(**kwargs):
        raise AssertionError("a local folder must not reach the Hub")

    monkeypatch.setattr(hub_source, "snapshot_download", refuse)
    hf_to_mp(str(src), tmp_path / "mp2", tp=1, pp=1)


def test_hub_offline_without_cache_is_one_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(CheckpointError, match="nor in the local Hugging Face cache, and HF_HUB_OFFLINE is set"):
        hf_to_mp("someone/not-cached", tmp_path / "mp", tp=1, pp=1)
    assert not (tmp_path / "mp").exists()


def closed_port() -> int:
    """A local TCP port nobody listens on: a connect to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_hub_is_one_clear_error_at_once(monkeypatch, tmp_path):
    """Offline without HF_HUB_OFFLINE, huggingface_hub would retry for about half a minute; the probe
    answers within its own timeout, and the model name that was not found is in the line."""
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(hub_constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    start = time.monotonic()
    with pytest.raises(CheckpointError, match="someone/not-cached: .* 127.0.0.1 cannot be reached"):
        hf_to_mp("someone/not-cached", tmp_path / "mp", tp=1, pp=1)
    with pytest.raises(UnsupportedConfigError, match="someone/not-cached: .* cannot be reached.*built-in names"):
        resolve_model("someone/not-cached")
    assert time.monotonic() - start < 2 * hub_source.PROBE_TIMEOUT_S
    assert not (tmp_path / "mp").exists()


def test_load_chunks_checks_the_layout(sources, tmp_path):
    hf_to_mp(sources["qwen2"], tmp_path / "mp", tp=1, pp=1, vpp=2)
    assert (tmp_path / "mp" / LATEST_FILE).read_text().strip() == "release"
    ps = make_ps(tp=1, pp=1, vpp=2, world=1)
    chunks = load_chunks(MPCheckpoint(tmp_path / "mp"), ps)
    assert [c.layer_ids for c in chunks] == [[0, 1], [2, 3]]
    with pytest.raises(LayoutError, match=r"saved with TP=1 PP=1 VPP=2, but this run uses TP=1 PP=1 VPP=1") as e:
        load_chunks(MPCheckpoint(tmp_path / "mp"), make_ps(world=1))
    assert f"reshard it with tools/reshard_mp.py --mp {tmp_path / 'mp' / 'release'} --out NEW --tp 1 --pp 1 " \
        "--vpp 1" in str(e.value)



def _save_live_chunks(mp22, mp21, out):
    """Save TP2 x PP2 chunks as iteration 7, then TP2 x DP2 chunks as iteration 8, from live models."""
    import torch.distributed as dist

    from hfmeg.checkpoint.mp_save import chunks_layout, staged_save, write_model_shard

    rank = dist.get_rank()
    for mp, pp, it in ((mp22, 2, 7), (mp21, 1, 8)):
        ps = make_ps(tp=2, pp=pp)
        chunks = load_chunks(MPCheckpoint(mp), ps)
        layout = chunks_layout(chunks, ps, it)
        with staged_save(layout, ps, out, f"{mp}/release/hf") as folder:
            rank_dir = write_model_shard(chunks, ps, layout, folder)
            (rank_dir / f"extra_{rank}.txt").write_text("optimizer shard")


def test_save_live_chunks_then_export_bit_exact(sources, tmp_path):
    from hfmeg.parallel.launch import spawn

    src, out = sources["llama_tied"], tmp_path / "ckpt"
    hf_to_mp(src, tmp_path / "mp22", tp=2, pp=2)
    hf_to_mp(src, tmp_path / "mp21", tp=2, pp=1)
    spawn(_save_live_chunks, 4, str(tmp_path / "mp22"), str(tmp_path / "mp21"), str(out))
    assert (out / LATEST_FILE).read_text().strip() == "8"
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000007", "iter_0000008", LATEST_FILE]
    assert sorted(p.name for p in (out / "iter_0000008" / "mp_rank_00").iterdir()) == \
        ["extra_0.txt", "extra_2.txt", "model.safetensors"]  # DP replicas share the TP rank's folder
    assert (out / "iter_0000007" / "mp_rank_01_001" / "extra_3.txt").is_file()
    assert MPLayout.read(out / "iter_0000007").iteration == 7
    mp_to_hf(out, tmp_path / "hf8")
    assert_same_tensors(src, tmp_path / "hf8")
    mp_to_hf(out, tmp_path / "hf7", iteration=7)
    assert_same_tensors(src, tmp_path / "hf7")
