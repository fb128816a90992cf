"""LoRA runs of the trainer around the numerics: bit-exact resume (also at another DP size) and a changed
base refused, optimizer bytes only for adapters, one-line config errors, the recipe (the Hub upload is
test_export_portable.py's).

The base and the starting adapter are conftest's `stories_lora`; the run config is test_peft_train.py's.
"""

from __future__ import annotations

import json
import shutil
import sys

import forkrun
import pytest
from safetensors.torch import load_file, save_file

from bounds import within
from helpers import make_ps, script_rank
from hfmeg.checkpoint.hf_reader import HFCheckpoint
from hfmeg.checkpoint.load import load_chunks
from hfmeg.errors import HfmegError
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.distributed_optimizer import DistributedOptimizer
from hfmeg.parallel.launch import spawn
from hfmeg.peft.adapters import attach, initialise
from hfmeg.peft.config import PeftConfig
from hfmeg.train.validate import load_config
from test_peft_train import ALPACA, ROOT, _config
from test_train import _losses, _run


def test_resume_is_exact_and_refuses_a_changed_base(stories_lora, tmp_path):
    base0, adapter0 = stories_lora
    base = tmp_path / "base"
    shutil.copytree(base0, base)
    spawn(_run, 4, _config(tmp_path / "straight", base, adapter0, tp=2, steps=6))
    spawn(_run, 4, _config(tmp_path / "split", base, adapter0, tp=2, steps=3, save_every=3, schedule_steps=6))
    spawn(_run, 4, _config(tmp_path / "split", base, adapter0, tp=2, steps=6, resume="auto"))
    straight = _losses(tmp_path / "straight")
    assert _losses(tmp_path / "split") == straight
    # At another DP size (TP2 x DP1 from TP2 x DP2's step 3): the same batches, the DP sum in another order.
    step3 = tmp_path / "split" / "checkpoints" / "iter_0000003"
    spawn(_run, 2, _config(tmp_path / "dp1", base, adapter0, tp=2, steps=6, resume=str(step3)))
    resumed = _losses(tmp_path / "dp1")
    assert len(resumed) == 3
    # fp32 rounding of a reordered sum
    within(max(abs(x - y) / abs(y) for x, y in zip(resumed, straight[3:])), 1e-5, "resume at DP1 loss rel",
           (resumed, straight))
    weights = load_file(str(base / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(Exception, match="differ from the base the checkpoint's adapters were trained on"):
        spawn(_run, 4, _config(tmp_path / "split", base, adapter0, tp=2, steps=8, resume="auto"))
    proc = forkrun.run([sys.executable, str(ROOT / "tools" / "convert_mp_to_hf.py"), "--mp",
                        str(tmp_path / "split" / "checkpoints"), "--out", str(tmp_path / "a"), "--merge",
                        str(tmp_path / "m")], timeout=300)  # refused before any tensor is computed: forked
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "has changed" in proc.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "m").exists()


def test_only_adapters_get_main_grads_masters_and_moments(stories_lora):
    base, _ = stories_lora
    ps = make_ps()
    chunks = load_chunks(HFCheckpoint(base), ps)
    cfg = PeftConfig(method="lora", r=4, target_modules=["all-linear"])
    for chunk in chunks:
        attach(chunk, cfg)
        initialise(chunk, cfg, seed=0)
    opt = DistributedOptimizer(chunks, ps, OptimizerConfig(lr=1e-3, mode="distributed"))
    # stories260K: 5 layers, h 64, q 64, kv 32, ffn 172; per layer sum over projections of r (in + out).
    per_layer = 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 172) * 2 + (172 + 64))
    adapters = 5 * per_layer
    assert sum(p.numel() for c in chunks for p in c.parameters() if p.requires_grad) == adapters
    assert sum(g.grad_buffer.numel() for g in opt.groups) == adapters  # fp32 main grads
    assert opt.master.numel() == opt.exp_avg.numel() == opt.exp_avg_sq.numel() == adapters
    frozen = sum(p.numel() for c in chunks for p in c.parameters() if not p.requires_grad)
    assert frozen == 292_800  # the whole base (vocab 512 needs no padding) gets none of those bytes


@pytest.mark.parametrize("override, field", [
    ({"peft.r": 0}, "peft.r"), ({"peft.target_modules": ["qkv"]}, "peft.target_modules"),
    ({"peft.alpha": 0}, "peft.alpha"), ({"peft.dropout": 1.5}, "peft.dropout"),
    ({"peft.modules_to_save": ["norm"]}, "peft.modules_to_save")])
def test_bad_peft_settings_name_the_field(override, field, tmp_path):
    base = {"model.path": "some/model", "data.sources": [{"path": "x.json"}], "peft.method": "lora",
            "checkpoint.out": str(tmp_path / "o")}
    with pytest.raises(HfmegError) as e:
        load_config(None, {**base, **override}, world_size=1)
    assert str(e.value).startswith(field) and "\n" not in str(e.value)


def test_recipe_runs_with_peft_lora(stories_lora, tmp_path):
    """recipes/sft_llama13b.py --peft lora on CPU: a short run that writes both exports."""
    base, _ = stories_lora
    out = tmp_path / "recipe"
    # one launch.spawn rank runs the script (the plain `python recipe` start: test_run_lifecycle.py)
    assert spawn(script_rank, 1, str(ROOT / "recipes" / "sft_llama13b.py"), [
        "--model", str(base), "--data", str(ALPACA), "--peft", "lora", "--peft-r", "4", "--tp", "1", "--max-steps", "4",
        "--seq-len", "64", "--global-batch-size", "4", "--lr", "1e-2", "--warmup-steps", "1", "--out", str(out)]) == [0]
    assert len(_losses(out)) == 4
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 32 and config["lora_dropout"] == 0.05  # the YAML's
    assert (out / "hf" / "config.json").is_file()


def test_recipe_refuses_a_bad_rank_in_one_line(stories_lora, tmp_path):
    base, _ = stories_lora
    proc = forkrun.run([sys.executable, str(ROOT / "recipes" / "sft_llama13b.py"), "--model", str(base),
                        "--data", str(ALPACA), "--peft", "lora", "--peft-r", "0", "--tp", "1",
                        "--out", str(tmp_path / "x")], timeout=300)  # refused at the config: forked
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: peft.r: must be an integer >= 1, got 0"], proc.stderr
