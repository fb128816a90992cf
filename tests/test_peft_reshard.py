"""LoRA checkpoints at another layout: `reshard_mp.py` on a LoRA training checkpoint (TP2 x PP2 -> TP4,
then resumed), and `convert_hf_to_mp.py --adapter` (a peft-made adapter imported onto the shards).

Both move adapter tensors without computing anything, so what they write must come back bit for bit;
the resumed run differs from the uninterrupted one only in the order of its TP sums.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft_helpers import make_base_and_adapter
from safetensors import safe_open
from safetensors.torch import load_file
from test_peft_train import _config
from test_train import _losses, _run
from tiny_models import save_tiny
from tool_loader import load_tool
from transformers import AutoModelForCausalLM

from hfmeg.parallel.launch import spawn
from hfmeg.peft.adapter_files import WEIGHTS_FILE
from hfmeg.peft.export import export_checkpoint


def _optimizer_by_name(iter_dir) -> dict[str, dict[str, torch.Tensor]]:
    """Every optimizer state of every (TP rank, parameter) in a checkpoint, DP pieces joined, TP slices
    kept apart (the same layout on both sides of a round trip)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted((iter_dir / "optim").glob("optim_*.safetensors")):
        tp = path.name.split("_")[2]
        with safe_open(str(path), "pt") as f:
            meta = json.loads(f.metadata()["hfmeg_optimizer"])
            flats = {s: f.get_tensor(s) for s in ("master", "exp_avg", "exp_avg_sq")}
        for name, lo, hi, off in meta["pieces"]:
            for s, flat in flats.items():
                out.setdefault(f"{tp}/{name}/{s}", []).append((lo, flat[off: off + hi - lo]))
    return {k: torch.cat([v for _, v in sorted(parts, key=lambda x: x[0])]) for k, parts in out.items()}


def test_resharded_lora_checkpoint_resumes_and_exports_the_same_adapter(stories_lora, tmp_path):
    base, adapter0 = stories_lora
    reshard = load_tool("reshard_mp")
    spawn(_run, 4, _config(tmp_path / "a", base, adapter0, tp=2, pp=2, steps=6, save_every=3))
    straight = _losses(tmp_path / "a")
    step3 = tmp_path / "a" / "checkpoints" / "iter_0000003"
    assert reshard.main(["--mp", str(tmp_path / "a" / "checkpoints"), "--iteration", "3", "--out",
                         str(tmp_path / "tp4"), "--tp", "4", "--pp", "1"]) == 0
    moved = tmp_path / "tp4" / "iter_0000003"
    assert sorted(p.name for p in moved.glob("mp_rank_*")) == [f"mp_rank_0{t}" for t in range(4)]
    # Only moved: the adapter exported from the TP4 shards is the TP2 x PP2 one, bit for bit ...
    exports = [load_file(str(export_checkpoint(d, tmp_path / f"export_{i}") / WEIGHTS_FILE))
               for i, d in enumerate((step3, moved))]
    assert exports[0].keys() == exports[1].keys() and all(torch.equal(exports[0][k], exports[1][k])
                                                          for k in exports[0])
    # ... and the optimizer state comes back bit for bit from TP4 to TP2 x PP2.
    assert reshard.main(["--mp", str(tmp_path / "tp4"), "--out", str(tmp_path / "back"), "--tp", "2",
                         "--pp", "2"]) == 0
    before, after = _optimizer_by_name(step3), _optimizer_by_name(tmp_path / "back" / "iter_0000003")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)

    spawn(_run, 4, _config(tmp_path / "resumed", base, adapter0, tp=4, steps=6, resume=str(moved)))
    resumed = _losses(tmp_path / "resumed")
    assert len(resumed) == 3
    # The same adapters, moments and batches; only the TP sums run in another order (4 partial sums instead
    # of 2 x stage-split): fp32 rounding, ~1e-7 relative per op, a few 1e-7 over 3 steps (measured <= 1.4e-7).
    # Anything wrong in the move (a slice, a moment, the step count) shows at 1e-3 or more.
    for x, y in zip(resumed, straight[3:]):
        assert abs(x - y) <= 1e-5 * abs(y), (resumed, straight)


def _dropout(cfg):
    return replace(cfg, peft=replace(cfg.peft, dropout=0.1))


def test_a_lora_reshard_carries_the_dropout_rng_or_the_resume_says_it_is_not_exact(stories_lora, tmp_path, capfd):
    """TP2 -> TP1: each new rank takes its stage's random state, so the dropout masks, and the losses, are the
    uninterrupted run's. TP2 -> TP1 x PP2: each stage would draw for other layers; no state is carried and
    the resume says so in one line."""
    base, adapter0 = stories_lora
    reshard = load_tool("reshard_mp")
    spawn(_run, 2, _dropout(_config(tmp_path / "a", base, adapter0, tp=2, steps=6, save_every=3)))
    straight = _losses(tmp_path / "a")
    for name, pp in (("tp1", 1), ("pp2", 2)):
        assert reshard.main(["--mp", str(tmp_path / "a" / "checkpoints"), "--iteration", "3", "--out",
                             str(tmp_path / name), "--tp", "1", "--pp", str(pp)]) == 0
    assert [p.name for p in (tmp_path / "tp1" / "iter_0000003" / "rng").iterdir()] == ["rank_00000.json"]
    assert not (tmp_path / "pp2" / "iter_0000003" / "rng").exists()
    capfd.readouterr()
    spawn(_run, 1, _dropout(_config(tmp_path / "resumed", base, adapter0, steps=6,
                                    resume=str(tmp_path / "tp1" / "iter_0000003"))))
    resumed = _losses(tmp_path / "resumed")
    # Without the carried state the masks differ and the losses move by ~1e-4; only the TP sums' order differs here.
    assert len(resumed) == 3 and all(abs(x - y) <= 1e-6 * abs(y) for x, y in zip(resumed, straight[3:])), \
        (resumed, straight)
    assert "resume not exact" not in capfd.readouterr().out
    spawn(_run, 2, _dropout(_config(tmp_path / "split", base, adapter0, pp=2, steps=4,
                                    resume=str(tmp_path / "pp2" / "iter_0000003"))))
    said = [line for line in capfd.readouterr().out.splitlines() if line.startswith("resume not exact")]
    assert said == [f"resume not exact: {tmp_path / 'pp2' / 'iter_0000003' / 'rng'}: absent (resharded to another "
                    "pipeline split, whose stages draw for other layers); peft.dropout 0.1 draws other masks than "
                    "the uninterrupted run from here on"], said


@pytest.mark.parametrize("options", [dict(dora=True), dict(modules_to_save=["embed_tokens", "lm_head"])])
def test_convert_with_adapter_exports_the_peft_adapter_back_bit_exact(options, tmp_path):
    base, adapter = make_base_and_adapter(tmp_path, "llama3", **options)
    shards = tmp_path / "shards"
    assert load_tool("convert_hf_to_mp").main(["--hf", str(base), "--out", str(shards), "--tp", "2", "--pp", "2",
                                               "--adapter", str(adapter)]) == 0
    assert len(list(shards.glob("release/mp_rank_*/adapter.safetensors"))) == 4
    assert load_tool("convert_mp_to_hf").main(["--mp", str(shards), "--out", str(tmp_path / "back")]) == 0
    source, again = (load_file(str(f / WEIGHTS_FILE)) for f in (adapter, tmp_path / "back"))
    assert source.keys() == again.keys() and all(torch.equal(source[k], again[k]) for k in source)
    want, got = (json.loads((f / "adapter_config.json").read_text()) for f in (adapter, tmp_path / "back"))
    for field in ("r", "lora_alpha", "use_dora", "use_rslora", "modules_to_save", "peft_type"):
        assert want[field] == got[field], field
    # peft lists its targets as full module paths here; the projections they name are the same
    assert {t.split(".")[-1] for t in want["target_modules"]} == set(got["target_modules"])


def test_convert_refuses_an_adapter_of_another_model_in_one_line(tmp_path, capsys):
    """An adapter for a 3-layer model onto a 2-layer one: its layer-2 tensors adapt nothing here."""
    base, _ = make_base_and_adapter(tmp_path, "llama3")
    bigger = save_tiny("llama3", tmp_path / "bigger", num_hidden_layers=3)
    other = tmp_path / "other_adapter"
    get_peft_model(AutoModelForCausalLM.from_pretrained(bigger), LoraConfig(r=4, target_modules=["q_proj"],
                                                                            task_type="CAUSAL_LM")).save_pretrained(other)
    code = load_tool("convert_hf_to_mp").main(["--hf", str(base), "--out", str(tmp_path / "x"), "--tp", "1",
                                               "--pp", "1", "--adapter", str(other)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert code == 2 and len(err) == 1 and "adapts nothing" in err[0] and not (tmp_path / "x").exists(), err
