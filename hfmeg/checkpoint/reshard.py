"""MP layout -> MP layout, directly and streaming.

The source `MPCheckpoint` serves full HF tensors one rule at a time (TP slices of
the old layout merged with `rules.to_hf`), and `write_mp_checkpoint` cuts them
into the new layout's slices with `rules.to_local` as it writes each new rank
file. Peak memory is one full tensor plus its old and new slices; the model is
never materialised. The result is a release checkpoint of model weights only; a
training checkpoint is resharded whole by `hfmeg/train/reshard_checkpoint.py`.
"""

from __future__ import annotations

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

