"""A run's export: a checkpoint of `<out>` to `<out>/hf` (a LoRA run: also the PEFT folder `<out>/adapter`),
their model cards, the upload if asked, and last the export record. What the checkpoint becomes is its
model part's to write (`parts/`: `ModelPart.export`).

The trainer calls it at the end of a run (rank 0 alone, `Trainer.export`); `hfmeg export` calls it on a
finished or interrupted run's checkpoint. The card's metrics are those `metrics.jsonl` logged up to the
checkpoint's step. The record (`<out>/export.json`: the step and the Hub repo it finished for) is written
last, so a run that died in its export or upload is exported again by the next run on this `<out>`.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from ..checkpoint.atomic import write_text_atomic
from ..checkpoint.mp_layout import HF_DIR
from ..checkpoint.tokenizer_files import make_portable
from ..data.formats import Formatter
from ..data.sources import Source
from ..hub import push_to_hub, write_model_card
from ..peft.export import read_info
from .config import TrainConfig
from .metrics import METRICS_FILE, rows_until
from .parts import part_class
from .grpo import CARD_METRICS as GRPO_METRICS
from .preference import METRICS

EXPORT_RECORD = "export.json"  # {"step", "pushed_to"} of the finished export in <out>/hf


def prompt_format(cfg: TrainConfig, tokenizer) -> tuple[str | None, str]:
    """The chat template to record in the export's tokenizer config (None: nothing to add) and, for the
    card, which one the run trained with: the tokenizer's own, hfmeg's default (`data/formats.py`, for a
    tokenizer that has none, recorded then), or none for plain text."""
    if all(cfg.data.fields_of(s)[0] == "text" for s in cfg.data.sources):
        return None, "plain text, no chat template (none was used in training, none recorded)"
    if cfg.data.preference and _string_pairs(cfg):
        return None, ("preference pairs used as their texts are (prompt, then the answer with EOS appended; no chat "
                      "template was used, none recorded)")
    template = Formatter(cfg.data, tokenizer).template
    if template == tokenizer.chat_template:
        return None, "the base tokenizer's own chat template"
    return template, ("hfmeg's default chat template (`### Instruction:` / `### Response:`), which the base "
                      "tokenizer lacked; recorded as this tokenizer's `chat_template`")


def _string_pairs(cfg: TrainConfig) -> bool:
    """The first source's first record has string answers (TRL's standard layout, used as it is) rather than
    messages; a Hub stream is not opened for this (False)."""
    source = Source(cfg.data.sources[0])
    fmt, fields = cfg.data.fields_of(source.cfg)
    if source.files is None:
        return False
    first = next((r.record for r in source.everything() if r.record is not None), None)
    return fmt == "preference" and first is not None and isinstance(first.get(fields["chosen"]), str)


def export_run(out: Path, checkpoint: Path, cfg: TrainConfig, *, step: int, skipped_steps: int,
               dp: int | None) -> Path:
    """Export `checkpoint` (of the run `cfg` in `out`, at `step`, trained at data-parallel size `dp` where known)
    to `out / "hf"`, which is returned. The exported tokenizer records the chat template the run trained with
    and loads with every transformers version hfmeg allows (`make_portable`)."""
    (out / EXPORT_RECORD).unlink(missing_ok=True)
    hf, adapter = part_class(cfg).export(checkpoint, out)
    logged = rows_until(out / METRICS_FILE, step)
    rows = [r for r in logged if "loss" in r]
    shown = ("step", "loss", "grad_norm", "tokens_per_s", *METRICS, *GRPO_METRICS)  # an objective's rewards too
    final = {k: rows[-1][k] for k in shown if k in rows[-1]} if rows else {}
    evals = [r for r in logged if "eval_loss" in r]
    if evals:
        final["eval_loss"] = evals[-1]["eval_loss"]
    final["skipped_steps"] = skipped_steps
    m, p = cfg.model, cfg.parallel
    objective = cfg.grpo if cfg.grpo.enabled else cfg.preference  # the one that is enabled, if any
    template, trained_format = prompt_format(cfg, AutoTokenizer.from_pretrained(str(checkpoint / HF_DIR)))
    make_portable(hf, chat_template=template)  # the export loads with AutoTokenizer as training rendered
    layout = dict(tp=p.tp, pp=p.pp, **({"dp": dp} if dp else {}), cp=p.cp, ep=p.ep,
                  sequence_parallel=p.sequence_parallel, optimizer=cfg.optim.mode)
    card = dict(base_model=m.source, data=[s.path for s in cfg.data.sources], config=cfg.to_dict(),
                metrics=final, repo_id=cfg.hub.push_to_hub, peft=read_info(checkpoint)[0] if adapter else None,
                layout=layout, dtype=m.dtype, prompt_format=trained_format,
                objective=objective.describe(adapter is not None) if objective.enabled else None,
                tags=(objective.tag,) if objective.enabled else (), fp8=m.fp8)
    write_model_card(hf, **card, from_scratch=m.init == "random")
    if adapter is not None:  # a LoRA run publishes its adapter, which names the base it loads onto
        write_model_card(adapter, **card, adapter=True)
    if cfg.hub.push_to_hub:
        url = push_to_hub(adapter or hf, cfg.hub.push_to_hub, private=cfg.hub.private)
        print(f"pushed to {url}")
    record = {"step": step, "pushed_to": cfg.hub.push_to_hub}
    write_text_atomic(out / EXPORT_RECORD, json.dumps(record))
    return hf
