"""Rank grid, layout errors and build-time rejection of unsupported configs."""

from __future__ import annotations

import pytest

from helpers import make_ps
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.config import load_hf_config
from hfmeg.families import model_config_from_hf
from hfmeg.errors import CheckpointError, LayoutError, UnsupportedConfigError
from hfmeg.parallel.launch import spawn
from tiny_models import save_tiny


def _grid():
    ps = make_ps(tp=2, pp=2)
    return dict(tp=ps.tp_ranks, dp=ps.dp_ranks, pp=ps.pp_ranks, emb=ps.embedding_ranks,
                coords=(ps.tp_rank, ps.dp_rank, ps.pp_rank), next=ps.next_rank, prev=ps.prev_rank)


def test_rank_grid_tp_fastest_then_dp_then_pp():
    grid = spawn(_grid, 8)
    for rank, g in enumerate(grid):
        tp_rank, dp_rank, pp_rank = g["coords"]
        assert rank == tp_rank + 2 * (dp_rank + 2 * pp_rank)
        assert g["tp"] == [rank - tp_rank, rank - tp_rank + 1]
        assert g["dp"] == [tp_rank + 4 * pp_rank, tp_rank + 2 + 4 * pp_rank]
        assert g["pp"] == [rank % 4, rank % 4 + 4]
        assert g["emb"] == [rank % 4, rank % 4 + 4]
        assert g["next"] == g["prev"] == (rank + 4) % 8


def _cp_grids():
    out = []
    for tp, cp, pp in ((2, 2, 1), (1, 2, 2)):  # DP 2 in both
        ps = make_ps(tp=tp, cp=cp, pp=pp)
        out.append(dict(coords=(ps.tp_rank, ps.cp_rank, ps.dp_rank, ps.pp_rank), tp=ps.tp_ranks, cp=ps.cp_ranks,
                        dp=ps.dp_ranks, dp_cp=ps.dp_cp_ranks, pp=ps.pp_ranks, dp_cp_rank=ps.dp_cp_rank,
                        edp=(ps.edp, ps.edp_rank), next=ps.next_rank))
    ps = make_ps(cp=2, ep=2)  # DP 4: EP ranks are DP neighbours of one CP rank; experts summed over edp x CP
    out.append(dict(ep=ps.ep_ranks, expert_dp=ps.expert_dp_ranks, edp=(ps.edp, ps.edp_rank)))
    return out


def test_rank_grid_cp_between_tp_and_dp():
    """Megatron's order: TP fastest, then CP, DP, PP; gradients are summed over DP x CP."""
    grids = spawn(_cp_grids, 8)
    for layout, (tp, cp, pp) in enumerate(((2, 2, 1), (1, 2, 2))):
        dp = 8 // (tp * cp * pp)
        for rank, g in enumerate(grids[r][layout] for r in range(8)):
            t, c, d, p = g["coords"]
            assert rank == t + tp * (c + cp * (d + dp * p)), g
            base = rank - tp * c
            assert g["cp"] == [base + tp * k for k in range(cp)]  # same TP, DP, PP coordinates
            assert g["dp"] == [t + tp * (c + cp * k) + tp * cp * dp * p for k in range(dp)]
            assert g["dp_cp"] == [t + tp * k + tp * cp * dp * p for k in range(cp * dp)]  # same TP, PP
            assert g["dp_cp"].index(rank) == g["dp_cp_rank"] == c + cp * d
            assert g["edp"] == (dp * cp, c + cp * d)  # EP 1: the expert-DP group is DP x CP
            assert g["tp"] == [rank - t + k for k in range(tp)]
            assert g["pp"] == [rank % (tp * cp * dp) + k * tp * cp * dp for k in range(pp)]
            assert g["next"] == (rank + tp * cp * dp) % 8 if pp > 1 else g["next"] == rank
    for rank in range(8):  # rank = cp_rank + 2 * dp_rank, dp_rank = ep_rank + 2 * edp_index
        g, c, d = grids[rank][2], rank % 2, rank // 2
        assert g["ep"] == [c + 2 * (2 * (d // 2) + e) for e in range(2)]
        assert g["expert_dp"] == [k + 2 * (d % 2 + 2 * j) for j in range(2) for k in range(2)]
        assert g["edp"] == (4, c + 2 * (d // 2)) and g["expert_dp"].index(rank) == g["edp"][1]


def test_world_not_multiple_of_tp_pp():
    with pytest.raises(LayoutError, match="world size 6 is not a multiple of TP x CP x PP = 4 x 1 x 1"):
        make_ps(tp=4, world=6)


@pytest.mark.parametrize(
    "kind, overrides, match",
    [
        ("llama3", {"model_type": "falcon"}, "model_type: 'falcon' is not supported"),
        ("llama3", {"hidden_act": "gelu"}, "hidden_act"),
        ("llama3", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "rope_type"),  # transformers has it, hfmeg not
        ("gpt2", {"activation_function": "relu"}, "activation_function"),
    ],
)
def test_unsupported_config_rejected(kind, overrides, match):
    from tiny_models import tiny_config

    cfg = tiny_config(kind)
    for k, v in overrides.items():
        object.__setattr__(cfg, k, v)
    with pytest.raises(UnsupportedConfigError, match=match):
        model_config_from_hf(cfg)


def _build(folder, tp):
    ps = make_ps(tp=tp)
    load_chunks(HFCheckpoint(folder), ps)[0]


def test_heads_not_divisible_by_tp(tmp_path):
    folder = save_tiny("llama3", tmp_path / "m", hidden_size=96, num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(Exception, match="num_key_value_heads: 3 is not divisible by TP=4, nor TP by it"):
        spawn(_build, 4, str(folder), 4)


def test_shape_mismatch_names_tensor(tmp_path):
    folder = save_tiny("qwen2", tmp_path / "m")
    cfg = (folder / "config.json").read_text().replace('"intermediate_size": 128', '"intermediate_size": 96')
    (folder / "config.json").write_text(cfg)
    with pytest.raises(CheckpointError, match=r"gate_proj.weight has shape \[128, 64\], config.json implies \[96, 64\]"):
        _build_single(folder)


def _build_single(folder):
    ps = make_ps(world=1)
    return load_chunks(HFCheckpoint(folder), ps)[0]


def test_missing_config(tmp_path):
    with pytest.raises(UnsupportedConfigError, match="no config.json"):
        load_hf_config(tmp_path)


def test_split_layers_even_uneven_interleaved():
    from hfmeg.parallel.layout import rank_chunks, split_layers

    assert [list(s.layers) for s in split_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(s.layers) for s in split_layers(5, 3)] == [2, 2, 1]
    specs = split_layers(8, 2, vpp=2)
    assert [(s.pp_rank, s.virtual, list(s.layers)) for s in rank_chunks(specs, 1)] == [(1, 0, [2, 3]), (1, 1, [6, 7])]
    assert specs[0].pre_process and specs[-1].post_process and not specs[1].post_process
    assert [len(s.layers) for s in split_layers(32, 3, pp_layers=[11, 11, 10])] == [11, 11, 10]
    with pytest.raises(LayoutError, match="sums to 31"):
        split_layers(32, 3, pp_layers=[11, 10, 10])
    with pytest.raises(LayoutError, match="more than the model's 5 layers"):
        split_layers(5, 6)
