"""End-to-end preference tuning: DPO on stories260K with the asset's preference pairs (`dpo_en_demo.json`).

A one-process run and a TP2 x PP2 one see the same pairs: same losses and rewards step by step; the
reward accuracy on the training pairs rises from 0.5 and the margins grow; a LoRA run exports an adapter
`peft` loads onto the base; a run resumed from its checkpoint continues exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from bounds import within
from helpers import stories_or_skip
from peft_helpers import peft_logit_bound
from hfmeg.data import DataConfig, SourceConfig
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.lr_schedule import LRScheduleConfig
from hfmeg.parallel.launch import spawn
from hfmeg.peft.config import PeftConfig
from hfmeg.train.config import CheckpointArgs, LoopArgs, ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.metrics import read_metrics
from hfmeg.train.preference import PreferenceConfig
from hfmeg.train.trainer import Trainer
from tiny_models import ASSETS

PAIRS = ASSETS / "data" / "dpo_en_demo.json"


def _config(out: Path, model: Path, *, tp=1, pp=1, steps=30, lr=1e-3, peft="none", save_every=0, resume="none",
            schedule_steps=None, loss_type="sigmoid", reference="live", eval_every=0) -> TrainConfig:
    return TrainConfig(
        model=ModelArgs(path=str(model), dtype="fp32"),
        parallel=ParallelArgs(tp=tp, pp=pp),
        optim=OptimizerConfig(lr=lr, weight_decay=0.0, eps=1e-8),
        lr=LRScheduleConfig(warmup_steps=2, total_steps=schedule_steps or steps, min_lr=lr / 10),
        data=DataConfig(sources=[SourceConfig(str(PAIRS))], format="sharegpt_preference", seq_len=256,
                        eval_split=8 if eval_every else 0),
        preference=PreferenceConfig(loss_type=loss_type, beta=0.1, reference=reference),
        peft=PeftConfig(method=peft, r=8, alpha=16, dropout=0.0),
        train=LoopArgs(micro_batch_size=2, global_batch_size=4, max_steps=steps, eval_every=eval_every, eval_batches=2),
        checkpoint=CheckpointArgs(out=str(out), save_every=save_every, resume=resume),
        report_to=[],
    )


def _run(cfg: TrainConfig):
    r = Trainer(cfg).run()
    return r.hf_folder


def _rows(out: Path) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]


def _assets() -> Path:
    model = stories_or_skip()
    if not PAIRS.is_file():
        pytest.skip(f"{PAIRS} is absent")
    return model


def test_dpo_tp2_pp2_matches_one_process_and_learns(tmp_path):
    """30 steps: TP2 x PP2 computes what one process does, and the rewards separate the training pairs.

    Bound: a log-probability is a sum of per-token losses, which the two layouts add in another order; the suite's
    layout bound for such sums is EPS = 1e-4 relative (test_train.py's loss). A pair's margin d = (pc - rc) -
    (pr - rr) is then off by at most EPS (|pc| + |rc| + |pr| + |rr|), and the loss, whose slope in beta d is at
    most 1, by beta times that. All four are negative, so their means over the pairs, which the metrics give
    (rc = pc - rewards/chosen / beta), bound the mean."""
    model = _assets()
    spawn(_run, 1, _config(tmp_path / "single", model))
    spawn(_run, 4, _config(tmp_path / "grid", model, tp=2, pp=2))
    a, b = _rows(tmp_path / "single"), _rows(tmp_path / "grid")
    assert len(a) == len(b) == 30
    assert a[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # the policy starts as its reference: log 2
    beta, eps = 0.1, 1e-4
    for x, y in zip(a, b):
        lc, lr = x["logps/chosen"], x["logps/rejected"]
        sums = abs(lc) + abs(lc - x["rewards/chosen"] / beta) + abs(lr) + abs(lr - x["rewards/rejected"] / beta)
        within(abs(x["loss"] - y["loss"]), beta * eps * sums, "DPO 1 process vs TP2xPP2 loss", x["step"])
        within(abs(x["rewards/margins"] - y["rewards/margins"]), beta * eps * sums, "DPO 1 vs TP2xPP2 margin")
        for k in ("logps/chosen", "logps/rejected"):
            within(abs(x[k] - y[k]) / abs(x[k]), eps, f"DPO 1 vs TP2xPP2 {k} rel", x["step"])
    first, last = a[:10], a[-10:]
    mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "rewards/accuracies") > max(0.5, mean(first, "rewards/accuracies")), a
    assert mean(last, "rewards/margins") > mean(first, "rewards/margins"), a


def test_lora_dpo_exports_an_adapter_peft_loads(tmp_path):
    """LoRA DPO (the reference: the base with the adapters off) trains, and its adapter loads with peft onto the
    base and computes what the merged export computes."""
    from peft import PeftModel

    model = _assets()
    hf = spawn(_run, 2, _config(tmp_path / "lora", model, tp=2, steps=6, peft="lora", lr=5e-3))[0]
    rows = _rows(tmp_path / "lora")
    assert rows[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # fresh adapters: B = 0
    assert any(r["rewards/margins"] != 0 for r in rows[1:])
    ids = torch.randint(3, 500, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), tmp_path / "lora" / "adapter")
        merged = AutoModelForCausalLM.from_pretrained(hf)
        with_adapter = peft(ids).logits
        within((with_adapter - merged(ids).logits).abs().max().item(),
               peft_logit_bound(model, tmp_path / "lora" / "adapter", ids, with_adapter), "LoRA-DPO adapter vs merged")
    card = (Path(hf) / "README.md").read_text()
    assert "- objective: DPO (sigmoid loss), beta 0.1, against the base with the adapters off" in card, card
    assert "dpo" in card.split("---")[1]  # the Hub tag


@pytest.fixture(scope="module")
def live_run(tmp_path_factory) -> Path:
    """A 6-step TP2 run with the live reference, evaluated at steps 3 and 6: the uninterrupted run that both the
    resumed live run and the precomputed-reference run must reproduce (one run for both tests)."""
    out = tmp_path_factory.mktemp("dpo") / "live"
    spawn(_run, 2, _config(out, _assets(), tp=2, steps=6, eval_every=3))
    return out


def test_dpo_resume_continues_identically(live_run, tmp_path):
    """6 steps straight == 3, stop, resume for 3 more: the reference is loaded again, the policy resumed (past the
    warm-up, with an evaluation on each side of the stop: steps are not what a resume is checked by)."""
    model = _assets()
    spawn(_run, 2, _config(tmp_path / "split", model, tp=2, steps=3, eval_every=3, save_every=3, schedule_steps=6))
    spawn(_run, 2, _config(tmp_path / "split", model, tp=2, steps=6, eval_every=3, resume="auto"))
    assert len(_rows(tmp_path / "split")) == 6
    assert _rows(tmp_path / "split") == [
        {**r, "tokens_per_s": s["tokens_per_s"]} for r, s in zip(_rows(live_run), _rows(tmp_path / "split"))]


def test_precomputed_reference_gives_the_live_run(live_run, tmp_path):
    """`preference.reference: precomputed` (the reference read every batch of the run, and the eval batches, before
    the first step) trains and evaluates bit for bit as the live reference does, resumed too."""
    model = _assets()
    spawn(_run, 2, _config(tmp_path / "ahead", model, tp=2, steps=3, eval_every=3, reference="precomputed",
                           save_every=3, schedule_steps=6))
    spawn(_run, 2, _config(tmp_path / "ahead", model, tp=2, steps=6, eval_every=3, reference="precomputed",
                           resume="auto"))
    live, ahead = (read_metrics(folder / "metrics.jsonl") for folder in (live_run, tmp_path / "ahead"))
    assert len([r for r in live if "eval_loss" in r]) == 2
    drop = ("tokens_per_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in ahead] == \
        [{k: v for k, v in r.items() if k not in drop} for r in live]
