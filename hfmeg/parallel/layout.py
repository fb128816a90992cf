"""Which layers each pipeline stage (and virtual stage) holds.

The model is cut into `pp * vpp` contiguous chunks in model order. With
interleaving (vpp > 1) chunk `c` lives on pipeline rank `c % pp` as its virtual
chunk `c // pp`, so rank p holds chunks p, p + pp, p + 2pp, ... — the order the
interleaved 1F1B schedule consumes them in. The first chunk owns the embeddings,
the last the final norm and LM head.

Conversion writes this layout to disk and the trainer and schedules read it back,
so both sides agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LayoutError


@dataclass(frozen=True)
class ChunkSpec:
    index: int  # position in model order, 0 .. pp*vpp-1
    pp_rank: int
    virtual: int  # virtual chunk index on its rank
    layers: range
    pre_process: bool
    post_process: bool


def split_layers(num_layers: int, pp: int, vpp: int = 1, pp_layers: list[int] | None = None) -> list[ChunkSpec]:
    """Chunks in model order. `pp_layers` gives layers per chunk (length pp*vpp); default even.

    An even split gives the first `num_layers % (pp*vpp)` chunks one extra layer
    (e.g. 5 layers on PP=2 -> 3+2, PP=3 -> 2+2+1).
    """
    n = pp * vpp
    if pp < 1 or vpp < 1:
        raise LayoutError(f"pp and vpp must be >= 1, got pp={pp}, vpp={vpp}")
    if pp_layers is None:
        if n > num_layers:
            raise LayoutError(f"PP x VPP = {n} chunks is more than the model's {num_layers} layers")
        base, extra = divmod(num_layers, n)
        counts = [base + (1 if i < extra else 0) for i in range(n)]
    else:
        counts = list(pp_layers)
        if len(counts) != n:
            raise LayoutError(f"--pp-layers has {len(counts)} entries, expected PP x VPP = {n}")
        if any(c < 1 for c in counts):
            raise LayoutError(f"--pp-layers entries must be >= 1, got {counts}")
        if sum(counts) != num_layers:
            raise LayoutError(f"--pp-layers sums to {sum(counts)}, but the model has {num_layers} layers")
    specs, start = [], 0
    for c, count in enumerate(counts):
        specs.append(ChunkSpec(c, c % pp, c // pp, range(start, start + count), c == 0, c == n - 1))
        start += count
    return specs


def rank_chunks(specs: list[ChunkSpec], pp_rank: int) -> list[ChunkSpec]:
    """The chunks pipeline rank `pp_rank` holds, in virtual-chunk order."""
    return [s for s in specs if s.pp_rank == pp_rank]
