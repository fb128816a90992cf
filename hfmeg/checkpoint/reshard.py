"""MP layout -> MP layout, directly and streaming.

The source `MPCheckpoint` serves full HF tensors one rule at a time (TP slices of
the old layout merged with `rules.to_hf`), and `write_mp_checkpoint` cuts them
into the new layout's slices with `rules.to_local` as it writes each new rank
file. Peak memory is one full tensor plus its old and new slices; the model is
never materialised. The result is a release checkpoint of model weights only: a
training checkpoint's optimizer shards, step, LR-schedule position, data position
and RNG states are not carried, and `training_state_note` says so in as many words.
"""

from __future__ import annotations

import json
from pathlib import Path

from .convert import config_errors_name, write_mp_checkpoint
from .mp_layout import MPLayout, parse_dtype
from .mp_reader import MPCheckpoint


def reshard_mp(mp: str | Path, out: str | Path, *, tp: int, pp: int, vpp: int = 1, pp_layers: list[int] | None = None,
               dtype: str = "auto", vocab_multiple: int | None = None, overwrite: bool = False,
               iteration: int | None = None) -> Path:
    """Rewrite the MP checkpoint `mp` with layout TP x PP (x VPP) at `out` (vocab multiple kept by default)."""
    target = parse_dtype(dtype)
    source = MPCheckpoint(mp, iteration)
    mult = source.layout.vocab_multiple if vocab_multiple is None else vocab_multiple
    with config_errors_name(source.hf_dir):
        layout = MPLayout.build(source.cfg, tp=tp, pp=pp, vpp=vpp, pp_layers=pp_layers, vocab_multiple=mult)
    return write_mp_checkpoint(source, source.cfg, layout, source.hf_dir, out, dtype=target, overwrite=overwrite,
                               inputs=(Path(mp),))


def training_state_note(mp: str | Path, iteration: int | None = None) -> str | None:
    """What resharding the training checkpoint `mp` leaves behind, and how to go on; None for a release."""
    source = MPCheckpoint(mp, iteration)
    state = source.folder / "trainer_state.json"  # written by hfmeg.train.checkpointing
    if not state.is_file():
        return None
    try:
        step = json.loads(state.read_text()).get("step", "?")
    except (OSError, ValueError):
        step = "?"
    lay = source.layout
    return (f"note: {source.folder} is a training checkpoint (step {step}); only its model weights were resharded. "
            "Not carried: optimizer state (AdamW moments, fp32 master weights), step count, LR-schedule and data "
            "position, RNG. Train from the new folder with --model <out> --resume none (a new run: warm-up and data "
            f"restart), or continue this run exactly at its own layout TP={lay.tp} PP={lay.pp} VPP={lay.vpp} "
            "with --resume.")
