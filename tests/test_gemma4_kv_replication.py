"""KV replication decided per layer (`ModelConfig.kv_replicas(tp, layer)`), on Gemma 4's 31B as released (shrunk,
`tests/releases/`): at TP 4 its sliding layers' 4 KV heads are split whole while its full-attention layer's 2 KV heads,
whose values are their keys (`attention_k_eq_v`), are replicated on 2 ranks each, each holding
`[its share of group g's q rows; k_g]`.

- logits, loss and every gradient equal transformers' at TP 1, 2 and 4, SP off and on (`test_tp_parity._check_layouts`;
  the copies' key gradients, which carry the value path too, summed over their holders);
- HF -> TP 4 shards -> HF is bit-exact;
- LoRA on q/k/v is refused at TP 4 naming the full-attention layers' field (`num_global_key_value_heads`), not at 2.
"""

from __future__ import annotations

import pytest
import torch

from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.errors import UnsupportedConfigError
from hfmeg.families import model_config_from_hf
from hfmeg.parallel.launch import spawn
from hfmeg.peft.adapters import check_model
from hfmeg.peft.config import PeftConfig
from test_gemma4_releases import release_config, save_release
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


def test_lora_on_qkv_is_refused_where_a_layer_replicates():
    cfg = model_config_from_hf(release_config(RELEASE))
    lora = PeftConfig(method="lora", r=4, target_modules=["q_proj"])
    check_model(cfg, lora, tp=2)
    with pytest.raises(UnsupportedConfigError, match=r"\(num_global_key_value_heads 2 < TP=4\) is not supported"):
        check_model(cfg, lora, tp=4)
    check_model(cfg, PeftConfig(method="lora", r=4, target_modules=["o_proj", "gate_proj"]), tp=4)
