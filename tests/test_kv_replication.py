"""KV heads replicated when TP exceeds them (models/attention.py): Gemma-3-1B's published config (one KV head) and a
Llama-3.1-8B-shaped one with 2 KV heads, at TP 2 and 4 (TP 4 on the 2-KV-head model: blocks of 2 holders, a
group of their own).

- logits, loss and every gradient equal transformers' with SP off and on (`test_tp_parity._check_layouts`: the
  gradients of the K/V copies are summed over their holders, else the K/V gradients are off by about 100 %);
- the conversion at TP 2 and 4 comes back bit-exact, and so does an MP folder resharded from TP 4 to TP 2;
- training (full fine-tuning through the trainer: data-parallel buffers, distributed optimizer, clipped global
  norm) takes the losses of one process (LoRA on the replicated q/k/v: tests/test_kv_replication_lora.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from bounds import within
from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.reshard import reshard_mp
from hfmeg.parallel.launch import spawn
from release_models import published, save_release
from helpers import folder_tensors
from test_releases import _bytes
from test_tp_parity import _check_layouts, _check_report

RELEASES = ["gemma3_1b", "llama3_1_8b"]  # 4 query heads on 1 and on 2 KV heads


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv_replication")
    return {name: save_release(name, root / name) for name in RELEASES}


def _both(folders, ids):
    return [_check_layouts(folder, ids) for folder in folders]


def test_logits_loss_and_gradients_are_transformers_at_tp2_and_tp4(sources):
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    folders = [str(sources[n]) for n in RELEASES]
    for folder, report in zip(folders, spawn(_both, 4, folders, ids)[0]):
        _check_report(folder, ids, report)


@pytest.mark.parametrize("name", RELEASES)
def test_round_trip_and_reshard_are_bit_exact(sources, name, tmp_path):
    before = folder_tensors(sources[name])
    tp4 = hf_to_mp(sources[name], tmp_path / "tp4", tp=4, pp=1)
    backs = [mp_to_hf(tp4, tmp_path / "hf4"),
             mp_to_hf(hf_to_mp(sources[name], tmp_path / "tp2", tp=2, pp=1), tmp_path / "hf2"),
             mp_to_hf(reshard_mp(tp4, tmp_path / "tp4to2", tp=2, pp=1), tmp_path / "hf4to2")]
    for back in backs:
        after = folder_tensors(back)
        assert sorted(after) == sorted(before)
        assert [k for k in before if (before[k].dtype, before[k].shape, _bytes(before[k])) !=
                (after[k].dtype, after[k].shape, _bytes(after[k]))] == [], back


def _train_all(cfgs):
    """Each run config in turn in this world: its (loss, grad norm) per step."""
    from hfmeg.train.metrics import read_metrics
    from hfmeg.train.trainer import Trainer

    out = []
    for cfg in cfgs:
        trainer = Trainer(cfg)
        trainer.run()
        rows = read_metrics(Path(cfg.checkpoint.out) / "metrics.jsonl")
        out.append(([(r["loss"], r["grad_norm"]) for r in rows if "loss" in r], _copies_equal(trainer)))
    return out


def _copies_equal(trainer) -> dict[str, bool]:
    """{parameter holding K/V copies: whether its copies are equal on all their holders} after training (they
    must take identical steps)."""
    import torch.distributed as dist

    from hfmeg.parallel.roles import named_roles

    equal = {}
    for name, p, role in named_roles(trainer.chunks[0]):
        span = role.shared_span(p.shape)
        if span is None:
            continue
        mine = p.detach().reshape(-1)[span[0]:span[1]].contiguous()
        held = [torch.empty_like(mine) for _ in range(role.shared_by)]
        dist.all_gather(held, mine, group=trainer.ps.tp_block_group(role.shared_by))
        equal[name] = all(torch.equal(h, held[0]) for h in held)
    return equal


def test_training_takes_the_losses_of_one_process(sources, tmp_path):
    from helpers import stories_or_skip
    from hfmeg.data import DataConfig, SourceConfig
    from hfmeg.optim.config import OptimizerConfig
    from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
    from tiny_models import ASSETS

    stories, alpaca = stories_or_skip(), ASSETS / "data" / "alpaca_en_demo.json"
    if not alpaca.is_file():
        pytest.skip(f"{alpaca} is absent")

    def config(name: str, tp: int, sp: bool) -> TrainConfig:
        model = tmp_path / name
        if not model.exists():
            shutil.copytree(sources[name], model)
            for file in ("tokenizer.json", "tokenizer_config.json"):  # stories260K's ids (< 512) fit both
                shutil.copy(stories / file, model / file)
        return TrainConfig(model=ModelArgs(path=str(model), dtype="fp32"),
                           parallel=ParallelArgs(tp=tp, sequence_parallel=sp),
                           optim=OptimizerConfig(lr=2e-3, eps=1e-5, weight_decay=0.01, grad_clip=0.5),
                           data=DataConfig(sources=[SourceConfig(str(alpaca))], seq_len=64),
                           train=LoopArgs(micro_batch_size=1, global_batch_size=4, max_steps=4, eval_every=0),
                           checkpoint=CheckpointArgs(out=str(tmp_path / f"{name}-tp{tp}"), save_every=0, keep_last=1),
                           report_to=[])

    # Gemma at TP 2 x DP 2 (the copies' sums and the sharded optimizer together), LLaMA at TP 4 (blocks of 2)
    single = spawn(_train_all, 1, [config(n, 1, False) for n in RELEASES])[0]
    sharded = spawn(_train_all, 4, [config("gemma3_1b", 2, True), config("llama3_1_8b", 4, False)])[0]
    for name, (a, _), (b, equal) in zip(RELEASES, single, sharded):
        assert len(a) == len(b) == 4
        layers = published(name)["num_hidden_layers"]  # one QKV weight per layer (no biases)
        assert len(equal) == layers and all(equal.values()), equal
        assert min(norm for _, norm in a) > 0.5, a  # clipped every step: the norm counts each K/V element once
        for i, what in enumerate(("loss", "grad norm")):
            # Every run in launch.spawn ranks, one thread each whatever OMP_NUM_THREADS or the load: no thread count moves
            # these losses (docs/testing.md, bounds). The layout contract's 1e-4: fp32 sums in other orders over 4 steps.
            within(max(abs(x[i] - y[i]) / abs(x[i]) for x, y in zip(a, b)), 1e-4,
                   f"{name}: 1 process vs TP {what} rel", (a, b))


def test_shared_rows_are_the_last_rows_of_a_column_split_tensor():
    from hfmeg.optim.distributed_optimizer import _without
    from hfmeg.parallel.roles import ParamRole

    role = ParamRole("weight", tp_dim=0, shared_rows=2, shared_by=2)
    assert role.shared_span(torch.Size([5, 3])) == (9, 15)
    assert ParamRole("weight", tp_dim=0).shared_span(torch.Size([5, 3])) is None
    with pytest.raises(ValueError, match="split on dim 0"):
        ParamRole("weight", tp_dim=1, shared_rows=2, shared_by=2)
    assert _without(0, 20, [(3, 5), (9, 15)]) == [(0, 3), (5, 9), (15, 20)]
    assert _without(4, 12, [(0, 5), (9, 15)]) == [(5, 9)]
    assert _without(10, 12, [(0, 20)]) == []
