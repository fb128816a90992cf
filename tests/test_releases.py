"""The checkpoints people download, as published (`tests/releases/`, built by `release_models.save_release`): each
converts at TP2 x PP2, computes transformers' fp32 logits (max-abs within rounding of its float64 run) and its greedy
continuation, comes back bit-exact (every tensor, and config.json as published), and trains 3 steps at TP2 x PP2
(LoRA; full fine-tuning on a multimodal wrapper, where LoRA is refused, and on a family LoRA is not built for). Adding a release: its shrunk published
config in `tests/releases/<name>.json` and its line in `RELEASES`.

All releases share one 4-process world for the parity run and one for the training runs. A tensor the conversion
would neither place nor carry is refused in one line, before anything is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from bounds import within
from helpers import folder_tensors, logit_bound, make_ps, script_rank
from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf
from hfmeg.checkpoint.parity import reference_outputs, sharded_outputs
from hfmeg.errors import CheckpointError
from hfmeg.families import family_of
from hfmeg.parallel.launch import spawn
from release_models import published, save_release

# (release file in tests/releases/, a multimodal wrapper's tensor naming: transformers "4.x" or "5.x")
RELEASES = [
    ("llama2_13b", None),  # pretraining_tp 2
    ("smollm3_3b", None),  # pretraining_tp 2, NoPE every 4th layer, tied
    ("gemma2_9b", None),  # hidden_act beside hidden_activation, soft caps, sliding window
    ("gemma2_27b", None),  # query_pre_attn_scalar not head_dim
    ("llama3_1_8b", None),  # llama3 RoPE scaling under the legacy rope_scaling key
    ("qwen3_8b", None),  # QK-norm, head_dim of its own, max_window_layers with the window off
    ("mixtral_8x7b", None),  # experts (LoRA on them and the router)
    ("mistral_small_3_1_24b", "4.x"),  # untied LM head under language_model.lm_head, class default tied
    ("mistral_small_3_1_24b", "5.x"),
    ("ministral3_8b", "5.x"),  # ministral3 language model: queries scaled by position (Llama 4's scaling)
    ("qwen3_next_80b_a3b", None),  # Gated DeltaNet with per-key-head fused projections, MoE with a shared expert
]
IDS = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(7))  # below every shrunk vocabulary
NEW_TOKENS = 3


def _id(release) -> str:
    name, layout = release
    return name if layout is None else f"{name}-{layout}"


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """{release id: (source folder, TP2 x PP2 MP folder, the MP folder exported back)}."""
    root = tmp_path_factory.mktemp("releases")
    out = {}
    for release in RELEASES:
        key = _id(release)
        src = save_release(release[0], root / key / "src", layout=release[1])
        mp = hf_to_mp(src, root / key / "mp", tp=2, pp=2)
        out[key] = (src, mp, mp_to_hf(mp, root / key / "hf"))
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("release", RELEASES, ids=_id)
def test_round_trip_is_bit_exact_for_every_tensor_and_the_published_config(converted, release):
    src, _, hf = converted[_id(release)]
    before, after = folder_tensors(src), folder_tensors(hf)
    assert sorted(after) == sorted(before)
    assert [k for k in before if (before[k].dtype, before[k].shape, _bytes(before[k])) !=
            (after[k].dtype, after[k].shape, _bytes(after[k]))] == []
    assert json.loads((hf / "config.json").read_text()) == published(release[0])


def _outputs(jobs):
    """[(release id, MP folder)] -> {release id: (logits, greedy ids)} on rank 0, all at TP2 x PP2."""
    ps = make_ps(tp=2, pp=2)
    results = {key: sharded_outputs(mp, IDS, NEW_TOKENS, ps) for key, mp in jobs}
    return results if dist.get_rank() == 0 else None


def test_logits_and_greedy_continuation_are_transformers_at_tp2_pp2(converted):
    ours = spawn(_outputs, 4, [(key, str(mp)) for key, (_, mp, _) in converted.items()])[0]
    for key, (src, _, _) in converted.items():
        ref_logits, ref_ids = reference_outputs(src, IDS, NEW_TOKENS)
        logits, ids = ours[key]
        vocab = ref_logits.shape[-1]
        within((logits[..., :vocab] - ref_logits).abs().max().item(), logit_bound(src, IDS, ref_logits),
               f"{key} logits")
        assert ids[:, IDS.shape[1]:].tolist() == ref_ids[:, IDS.shape[1]:].tolist(), key


def _train_all(cfgs):
    """Each run config in turn in this world; their metrics files' losses."""
    from hfmeg.train.metrics import read_metrics
    from hfmeg.train.trainer import Trainer

    losses = []
    for cfg in cfgs:
        Trainer(cfg).run()
        losses.append([r["loss"] for r in read_metrics(Path(cfg.checkpoint.out) / "metrics.jsonl") if "loss" in r])
    return losses


def test_three_training_steps_at_tp2_pp2(converted, tmp_path):
    from helpers import stories_or_skip
    from hfmeg.data import DataConfig, SourceConfig
    from hfmeg.optim.config import OptimizerConfig
    from hfmeg.peft.config import PeftConfig
    from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
    from tiny_models import ASSETS

    stories, alpaca = stories_or_skip(), ASSETS / "data" / "alpaca_en_demo.json"
    if not alpaca.is_file():
        pytest.skip(f"{alpaca} is absent")
    cfgs = []
    for (key, (src, _, _)), (_, layout) in zip(converted.items(), RELEASES):
        model = tmp_path / key
        shutil.copytree(src, model)
        for name in ("tokenizer.json", "tokenizer_config.json"):  # stories260K's ids (< 512) fit every vocabulary
            shutil.copy(stories / name, model / name)
        lora = layout is None and family_of(published(key.split("-")[0])["model_type"]).peft is not None
        peft = PeftConfig(method="lora" if lora else "none", r=4, target_modules=["all-linear"])
        cfgs.append(TrainConfig(model=ModelArgs(path=str(model), dtype="fp32"), parallel=ParallelArgs(tp=2, pp=2),
                                optim=OptimizerConfig(lr=1e-3, eps=1e-5), peft=peft,
                                data=DataConfig(sources=[SourceConfig(str(alpaca))], seq_len=64),
                                train=LoopArgs(micro_batch_size=1, global_batch_size=2, max_steps=3, eval_every=0),
                                checkpoint=CheckpointArgs(out=str(tmp_path / f"{key}-out"), save_every=0, keep_last=1),
                                report_to=[]))
    for key, losses in zip(converted, spawn(_train_all, 4, cfgs)[0]):
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses))), (key, losses)


def test_a_tensor_nothing_places_is_refused_before_anything_is_written(tmp_path):
    src = save_release("llama2_13b", tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"src: tensor model\.layers\.0\.self_attn\.extra_proj\.weight is not "
                                              r"placed by the llama conversion rules and not carried; converting "
                                              r"would drop it \(not supported\)$"):
        hf_to_mp(src, tmp_path / "mp", tp=2, pp=2)
    assert not (tmp_path / "mp").exists()


def test_llama2_13b_as_published_through_the_sft_recipe_at_tp2_pp2(tmp_path):
    """recipes/sft_llama13b.py, the README's command, on Llama-2-13b-hf's published config (pretraining_tp 2) shrunk:
    4 ranks at TP2 x PP2 train 3 steps and export the published config.json unchanged. The ranks are
    `launch.spawn`'s, each running the script as a launcher's worker would (the recipe under torchrun itself:
    test_train.py, test_torchrun_faults.py)."""
    from helpers import stories_or_skip
    from multihost import ROOT, recipe_flags
    from tiny_models import ASSETS

    stories, alpaca = stories_or_skip(), ASSETS / "data" / "alpaca_en_demo.json"
    if not alpaca.is_file():
        pytest.skip(f"{alpaca} is absent")
    model = save_release("llama2_13b", tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories / name, model / name)
    out = tmp_path / "run"
    flags = recipe_flags(model, alpaca, out, "--tp", "2", "--pp", "2", steps=3)
    assert spawn(script_rank, 4, str(ROOT / "recipes" / "sft_llama13b.py"), flags) == [0] * 4
    from hfmeg.train.metrics import read_metrics

    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported == published("llama2_13b") | {"torch_dtype": exported["torch_dtype"]}
    assert exported["pretraining_tp"] == 2
