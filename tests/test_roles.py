"""Every parameter of every model family declares a role, and the roles agree with the key table.

`checkpoint.rules` says how each tensor is split over TP (its split kind); the role the
layer declared must say the same: column/row/vocab splits shard one dim, `replicated`
shards none. Chunks are built on the meta device (construction reads only the TP size,
rank and the SP flag), as TP=2 with SP, and as the two ends of a PP=2 tied model. The
grouped MoE experts are one stacked parameter per layer stored as one tensor per expert
(`parallel/stored_names.py`): each stored tensor has its parameter's role.
"""

from __future__ import annotations


import pytest
import torch

from hfmeg.checkpoint.rules import chunk_rules, split_of
from hfmeg.families import model_config_from_hf
from hfmeg.models.decoder import ModelChunk
from hfmeg.optim import OptimizerConfig, no_weight_decay
from hfmeg.parallel.grid import RankGrid
from hfmeg.parallel.roles import ParamRole, named_roles, role_of
from hfmeg.parallel.stored_names import stored_slices
from tests.tiny_models import MOE_KINDS, tiny_config

FAMILIES = ["llama3", "llama_tied", "mistral", "qwen2", "gpt2", "qwen3_5", "qwen3_5_moe", *MOE_KINDS]


def _chunk(kind: str, pre: bool, post: bool, sp: bool = True) -> ModelChunk:
    cfg = model_config_from_hf(tiny_config(kind))
    ps = RankGrid(tp=2, sequence_parallel=sp).place(1)  # TP rank 1 of 2
    with torch.device("meta"):
        return ModelChunk(cfg, ps, range(cfg.num_layers), pre_process=pre, post_process=post)


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("ends", [(True, True), (True, False), (False, True)], ids=["whole", "first", "last"])
def test_roles_match_split_kinds(kind, ends):
    chunk = _chunk(kind, *ends)
    rules = {r.local: r for r in chunk_rules(chunk.cfg, chunk.layer_ids, *ends)}
    assert [name for name, _, _ in named_roles(chunk)] == [n for n, _ in chunk.named_parameters()]
    slices = stored_slices(chunk)
    roles = {s: role for name, _, role in named_roles(chunk) for s in slices.get(name, [name])}
    assert set(roles) == set(rules)
    for name, role in roles.items():
        rule = rules[name]
        assert role.tp_dim == split_of(rule, chunk.cfg).tp_dim, name
        # Replicated parameters with partial gradients: norms and row-parallel biases (SP), q/k norms, MoE.
        sp = rule.kind in ("replicated", "fused") and name != "pos_embed.weight"
        assert role.sequence_parallel == sp, name
        assert role.expert == (".experts." in name), name
        assert role.tied_copy == rule.tied, name
        assert (role.tied is not None) == (chunk.cfg.tie_embeddings and name in ("embed.weight", "lm_head.weight"))


def test_sequence_parallel_off_without_sp():
    chunk = _chunk("gpt2", True, True, sp=False)
    assert not any(role.sequence_parallel for _, _, role in named_roles(chunk))


def test_moe_and_qk_norm_gradients_are_partial_without_sp_too():
    """Each TP rank routes its own tokens and normalises its own heads, SP or not (models/moe.py)."""
    chunk = _chunk("qwen3_moe", True, True, sp=False)
    partial = {name for name, _, role in named_roles(chunk) if role.sequence_parallel}
    assert partial == {name for name, _ in chunk.named_parameters() if ".mlp." in name and "layers.1." in name
                       or "_norm" in name and ".attn." in name}


def test_norm_counting_each_element_once():
    """Across the two TP ranks and both tied ends, each model tensor is counted by exactly one rank."""
    first, last = _chunk("llama_tied", True, False), _chunk("llama_tied", False, True)
    for name, _, role in [*named_roles(first), *named_roles(last)]:
        counted = [role.counted_on(r) for r in range(2)]
        if name == "lm_head.weight":
            assert counted == [False, False]
        elif role.tp_replicated:
            assert counted == [True, False], name
        else:
            assert counted == [True, True], name


def test_weight_decay_exclusion_by_kind():
    chunk = _chunk("gpt2", True, True)
    params = {name: role for name, _, role in named_roles(chunk)}
    default = {n for n, r in params.items() if no_weight_decay(r, OptimizerConfig())}
    assert default == {n for n in params if "norm" in n or n.endswith(".bias")}
    only_biases = OptimizerConfig(no_decay_norms=False)
    assert no_weight_decay(params["final_norm.bias"], only_biases)
    assert not no_weight_decay(params["final_norm.weight"], only_biases)
    embeddings = OptimizerConfig(no_decay_norms=False, no_decay_biases=False, no_decay_embeddings=True)
    assert {n for n, r in params.items() if no_weight_decay(r, embeddings)} == \
        {"embed.weight", "pos_embed.weight"}  # GPT-2 ties its head to embed.weight


def test_missing_role_is_a_clear_error():
    with pytest.raises(TypeError, match="has no role"):
        named_roles(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError):
        ParamRole("norm", tp_dim=0, sequence_parallel=True)



def test_roles_survive_materialising_and_casting():
    chunk = _chunk("qwen2", True, True).to_empty(device="cpu").to(torch.float64)
    assert role_of(chunk.layers["0"].attn.qkv, "bias") == ParamRole("bias", tp_dim=0)
    assert len(named_roles(chunk)) == len(list(chunk.parameters()))
