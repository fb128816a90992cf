"""LoRA and DoRA on q/k/v where TP exceeds the KV heads (`peft/adapters.py`): Gemma-3-1B's published config (one KV
head) and Gemma 4 E2B's (one KV head, KV sharing, double-wide MLPs), shrunk (`tests/releases/`), at TP 2, where each
rank's `k_proj`/`v_proj` B rows are a copy of its group's.

- logits, loss and every adapter gradient equal peft's on transformers at TP2, TP2 + SP and TP2 x PP2 (the E2B's
  split keeping its producers with their readers), within the bounds test_peft_parity derives from float64 runs;
  the B copies' gradients are summed over their holders (a holder alone has its query heads' part only); a peft-made
  adapter imported onto the TP2 x PP2 shards exports back bit for bit (one tensor per projection);
- 3 trainer steps (data-parallel buffers, distributed optimizer, clipped global norm that counts each copy once)
  take the losses of one process, and the copies stay equal on their holders; the exported adapter loads in peft
  and computes the logits hfmeg computes from the run's own shards; the checkpoint resharded to TP1 exports the same
  adapter, bit for bit.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from bounds import relative_bound, rounding_bound, within
from peft import LoraConfig, PeftModel, get_peft_model
from peft_helpers import peft_adapter
from release_models import save_release
from safetensors.torch import load_file
from test_gemma4_releases import save_release as save_gemma4_release
from test_kv_replication import _copies_equal
from test_peft_parity import _assert_parity, _check, _references
from test_peft_train import _peft_adamw_losses, logits_from_shards
from transformers import AutoModelForCausalLM

from hfmeg.families.llama import PROJECTIONS
from hfmeg.parallel.launch import spawn
from hfmeg.peft.adapter_files import WEIGHTS_FILE
from hfmeg.peft.export import export_checkpoint

# release: its pipeline split at PP2 (None: even). The E2B's keeps layers 3-9 (its producers 3 and 4, their readers
# 5-9) on one stage (KV sharing across stages is tested in test_gemma4_small_releases.py).
RELEASES = {"gemma3_1b": None, "gemma-4-E2B": [3, 7]}
LAYOUTS = [(2, 1, False), (2, 1, True), (2, 2, False)]  # tp, pp, sp; each TP rank holds a copy of the KV head


def _base(name: str, folder: Path) -> Path:
    return save_gemma4_release(name, folder) if name.startswith("gemma-4") else save_release(name, folder)


def _check_each(runs, ids):
    """`test_peft_parity._check` for each (cases, layouts, options) of `runs`, in this one world."""
    return [row for cases, layouts, options in runs for row in _check(cases, ids, layouts, options)]


def test_lora_and_dora_match_peft_under_replicated_kv(tmp_path):
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    cases, runs = {}, []
    for name, pp_layers in RELEASES.items():
        base = _base(name, tmp_path / name)
        cases[name] = [(base, peft_adapter(base, tmp_path / f"{name}_{method}", targets=list(PROJECTIONS),
                                           dora=method == "dora")) for method in ("lora", "dora")]
        names = set(load_file(str(cases[name][0][1] / WEIGHTS_FILE)))
        assert any(".self_attn.k_proj.lora_B" in k for k in names) and any(".self_attn.v_proj." in k for k in names)
        pairs = [(str(b), str(a)) for b, a in cases[name]]
        # the published Gemma-3-1B is stored in bf16: every layout computes in fp32, as the references do
        runs += [(pairs, LAYOUTS[:2], dict(dtype=torch.float32)),
                 (pairs, LAYOUTS[2:], dict(dtype=torch.float32, pp_layers=pp_layers))]
    refs = {name: _references(c, ids) for name, c in cases.items()}
    results = spawn(_check_each, 4, runs, ids)
    for name, c in cases.items():
        _assert_parity(results, refs[name], c, LAYOUTS)


def _train(cfgs):
    """Each run config in turn in this world; whether each run's K/V copies are equal on their holders after it."""
    from hfmeg.train.trainer import Trainer

    out = []
    for cfg in cfgs:
        trainer = Trainer(cfg)
        trainer.run()
        out.append(_copies_equal(trainer))
    return out


def test_three_lora_steps_equal_one_process_and_the_export_loads_in_peft(tmp_path):
    from helpers import stories_or_skip
    from hfmeg.data import DataConfig, SourceConfig
    from hfmeg.optim.config import OptimizerConfig
    from hfmeg.peft.config import PeftConfig
    from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
    from hfmeg.train.metrics import read_metrics
    from hfmeg.train.parts import reshard_training_checkpoint
    from tiny_models import ASSETS

    stories, alpaca = stories_or_skip(), ASSETS / "data" / "alpaca_en_demo.json"
    if not alpaca.is_file():
        pytest.skip(f"{alpaca} is absent")
    bases, adapters = {}, {}
    for name in RELEASES:
        bases[name] = _base(name, tmp_path / name)
        for f in ("tokenizer.json", "tokenizer_config.json"):  # stories260K's ids (< 512) fit the vocabulary
            shutil.copy(stories / f, bases[name] / f)
        # the runs start from a peft-made adapter (default init: B = 0), so peft + AdamW can train it again in float64
        torch.manual_seed(0)
        adapters[name] = tmp_path / f"{name}-adapter0"
        get_peft_model(AutoModelForCausalLM.from_pretrained(bases[name], dtype=torch.float32),
                       LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS), task_type="CAUSAL_LM")
                       ).save_pretrained(adapters[name])

    def config(name: str, tp: int, pp: int, sp: bool = False) -> TrainConfig:
        return TrainConfig(model=ModelArgs(path=str(bases[name]), dtype="fp32"),
                           parallel=ParallelArgs(tp=tp, pp=pp, sequence_parallel=sp,
                                                 pp_layers=RELEASES[name] if pp > 1 else None),
                           optim=OptimizerConfig(lr=1e-2, eps=1e-5, weight_decay=0.01, grad_clip=0.5),
                           peft=PeftConfig(method="lora", r=4, alpha=8, target_modules=list(PROJECTIONS),
                                           init_from=str(adapters[name])),
                           data=DataConfig(sources=[SourceConfig(str(alpaca))], seq_len=64),
                           train=LoopArgs(micro_batch_size=1, global_batch_size=4, max_steps=3, eval_every=0),
                           checkpoint=CheckpointArgs(out=str(tmp_path / f"{name}-tp{tp}pp{pp}"), save_every=0,
                                                     keep_last=1),
                           report_to=[])

    # Gemma-3-1B at TP2 x DP2 with SP (the copies' sums beside the sharded optimizer's), the E2B at TP2 x PP2
    single = [config(name, 1, 1) for name in RELEASES]
    sharded = [config("gemma3_1b", 2, 1, sp=True), config("gemma-4-E2B", 2, 2)]
    spawn(_train, 1, single)
    copies = spawn(_train, 4, sharded)
    ids = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(1))
    for name, one, cfg, equal in zip(RELEASES, single, sharded, copies[0]):
        losses = [[r["loss"] for r in read_metrics(Path(c.checkpoint.out) / "metrics.jsonl") if "loss" in r]
                  for c in (one, cfg)]
        assert len(losses[0]) == len(losses[1]) == 3
        # Two fp32 runs of 3 steps, the sums in other orders: within the rounding of the same steps as peft + AdamW
        # take them in fp32 against float64 (bounds.relative_bound, as tests/test_peft_train.py's runs are bounded).
        bound = relative_bound(*(_peft_adamw_losses(one, adapters[name], dtype=dtype)
                                 for dtype in (torch.float32, torch.float64)))
        within(max(abs(x - y) / abs(x) for x, y in zip(*losses)), bound, f"{name}: 1 process vs TP2 loss rel", losses)
        # the k_proj/v_proj B rows of every producing layer of rank 0's stage took identical steps on both holders
        assert any("adapter.k_proj.lora_B" in k for k in equal) and all(equal.values()), equal

        out = Path(cfg.checkpoint.out)
        ckpt = sorted((out / "checkpoints").glob("iter_*"))[-1]
        ours = [r for r in spawn(logits_from_shards, 4, bases[name], ckpt, ids) if r is not None][0]
        got = {}
        with torch.no_grad():
            for dtype in (torch.float32, torch.float64):
                plain = AutoModelForCausalLM.from_pretrained(bases[name], dtype=torch.float32)
                model = PeftModel.from_pretrained(plain, out / "adapter").to(dtype)
                got[dtype] = model(ids).logits
                if dtype == torch.float32:
                    with model.disable_adapter():
                        effect = (got[dtype] - model(ids).logits).abs().max().item()
        assert effect > 1e-3, "three steps must move the adapter for the test to bite"
        within((ours.double() - got[torch.float64]).abs().max().item(),
               rounding_bound(got[torch.float32], got[torch.float64]), f"{name}: peft on the export vs the shards", None)

        # TP2 -> TP1: only moved, so the same adapter, bit for bit
        tp1 = reshard_training_checkpoint(out / "checkpoints", tmp_path / f"{name}-tp1", tp=1, pp=1)
        exports = [load_file(str(export_checkpoint(d, tmp_path / f"{name}-export{i}") / WEIGHTS_FILE))
                   for i, d in enumerate((ckpt, sorted(Path(tp1).glob("iter_*"))[-1]))]
        assert exports[0].keys() == exports[1].keys() == set(load_file(str(out / "adapter" / WEIGHTS_FILE)))
        assert all(torch.equal(exports[0][k], exports[1][k]) for k in exports[0])
