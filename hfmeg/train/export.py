"""A run's export: a checkpoint of `<out>` to `<out>/hf` (a LoRA run: also the PEFT folder `<out>/adapter`),
their model cards, the upload if asked, and last the export record.

The trainer calls it at the end of a run (rank 0 alone, `Trainer.export`); `hfmeg export` calls it on a
finished or interrupted run's checkpoint. The card's metrics are those `metrics.jsonl` logged up to the
checkpoint's step. The record (`<out>/export.json`: the step and the Hub repo it finished for) is written
last, so a run that died in its export or upload is exported again by the next run on this `<out>`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint.atomic import write_text_atomic
from ..checkpoint.convert import mp_to_hf
from ..hub import push_to_hub, write_model_card
from .config import TrainConfig
from .metrics import METRICS_FILE, rows_until
from .peft_run import PeftRun

EXPORT_RECORD = "export.json"  # {"step", "pushed_to"} of the finished export in <out>/hf


def export_run(out: Path, checkpoint: Path, cfg: TrainConfig, *, step: int, skipped_steps: int) -> Path:
    """Export `checkpoint` (of the run `cfg` in `out`, at `step`) to `out / "hf"`, which is returned."""
    hf, adapter = out / "hf", None
    (out / EXPORT_RECORD).unlink(missing_ok=True)
    if cfg.peft.enabled:
        adapter, hf = PeftRun.export(checkpoint, out)
        print(f"LoRA adapter (PEFT format): {adapter}; merged model: {hf}")
    else:
        mp_to_hf(checkpoint, hf, overwrite=True)
    logged = rows_until(out / METRICS_FILE, step)
    rows = [r for r in logged if "loss" in r]
    final = {k: rows[-1][k] for k in ("step", "loss", "grad_norm", "tokens_per_s")} if rows else {}
    evals = [r for r in logged if "eval_loss" in r]
    if evals:
        final["eval_loss"] = evals[-1]["eval_loss"]
    final["skipped_steps"] = skipped_steps
    m = cfg.model
    card = dict(base_model=m.source, data=[s.path for s in cfg.data.sources], config=cfg.to_dict(),
                metrics=final, repo_id=cfg.hub.push_to_hub)
    write_model_card(hf, **card, from_scratch=m.init == "random")
    if adapter is not None:  # a LoRA run publishes its adapter, which names the base it loads onto
        write_model_card(adapter, **card, adapter=True)
    if cfg.hub.push_to_hub:
        url = push_to_hub(adapter or hf, cfg.hub.push_to_hub, private=cfg.hub.private)
        print(f"pushed to {url}")
    record = {"step": step, "pushed_to": cfg.hub.push_to_hub}
    write_text_atomic(out / EXPORT_RECORD, json.dumps(record))
    return hf
