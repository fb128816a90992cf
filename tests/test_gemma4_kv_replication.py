"""KV replication decided per layer (`ModelConfig.kv_replicas(tp, layer)`), on Gemma 4's 31B as released (shrunk,
`tests/releases/`): at TP 4 its sliding layers' 4 KV heads are split whole while its full-attention layer's 2 KV heads,
whose values are their keys (`attention_k_eq_v`), are replicated on 2 ranks each, each holding
`[its share of group g's q rows; k_g]`.

- logits, loss and every gradient equal transformers' at TP 1, 2 and 4, SP off and on (`test_tp_parity._check_layouts`;
  the copies' key gradients, which carry the value path too, summed over their holders);
- HF -> TP 4 shards -> HF is bit-exact;
- a peft LoRA on every projection imported onto the TP 4 shards (the full-attention layer's `k_proj` B rows copied on
  both holders of its group, the sliding layers' split by whole groups) exports back bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from safetensors.torch import load_file

from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.families import model_config_from_hf
from hfmeg.families.llama import PROJECTIONS
from hfmeg.parallel.launch import spawn
from hfmeg.peft.adapter_files import WEIGHTS_FILE, read_peft_folder
from hfmeg.peft.export import export_checkpoint
from hfmeg.peft.layout_shards import import_adapter
from test_gemma4_releases import make_adapter, release_config, save_release
from helpers import folder_tensors
from test_releases import _bytes
from test_tp_parity import _check_layouts, _check_report

RELEASE = "gemma-4-31B"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return save_release(RELEASE, tmp_path_factory.mktemp("g4_kv") / RELEASE)


def test_replication_is_per_layer():
    cfg = model_config_from_hf(release_config(RELEASE))
    assert [cfg.kv_replicas(4, i) for i in range(cfg.num_layers)] == [1, 1, 1, 1, 1, 2]
    assert (cfg.local_kv_heads(4, 0), cfg.local_kv_heads(4, 5)) == (1, 1)
    assert [cfg.kv_replicas(2, i) for i in range(cfg.num_layers)] == [1] * 6


def test_logits_loss_and_gradients_are_transformers_at_tp2_and_tp4(source):
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    _check_report(str(source), ids, spawn(_check_layouts, 4, str(source), ids)[0])


def test_round_trip_at_tp4_is_bit_exact(source, tmp_path):
    before = folder_tensors(source)
    after = folder_tensors(mp_to_hf(hf_to_mp(source, tmp_path / "tp4", tp=4, pp=1), tmp_path / "hf"))
    assert sorted(after) == sorted(before)
    assert [k for k in before if (before[k].dtype, before[k].shape, _bytes(before[k])) !=
            (after[k].dtype, after[k].shape, _bytes(after[k]))] == []


def test_lora_on_every_projection_moves_onto_tp4_shards_and_back_bit_exact(source, tmp_path):
    adapter = make_adapter(source, tmp_path / "adapter", list(PROJECTIONS))
    shards = hf_to_mp(source, tmp_path / "tp4", tp=4, pp=1) / "release"
    cfg, tensors = read_peft_folder(adapter)
    import_adapter(shards, cfg, tensors, str(source))
    held = [load_file(str(shards / f"mp_rank_{t:02d}" / "adapter.safetensors")) for t in range(4)]
    k_b = "layers.{}.attn.qkv.adapter.k_proj.lora_B"
    assert [held[t][k_b.format(5)].shape[0] for t in range(4)] == [16] * 4  # a whole head's rows on each holder
    assert torch.equal(held[0][k_b.format(5)], held[1][k_b.format(5)])
    assert not torch.equal(held[1][k_b.format(5)], held[2][k_b.format(5)])  # the next group's
    assert [held[t][k_b.format(0)].shape[0] for t in range(4)] == [8] * 4  # a sliding layer's: one of its 4 heads
    back = load_file(str(export_checkpoint(shards, tmp_path / "back") / WEIGHTS_FILE))
    source_tensors = load_file(str(adapter / WEIGHTS_FILE))
    assert back.keys() == source_tensors.keys() and all(torch.equal(back[k], source_tensors[k]) for k in back)
