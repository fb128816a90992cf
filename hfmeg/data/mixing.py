"""Deterministic weighted mixing of sources, resumable from a small `Position`.

Draw k picks source `choice(k)`, sampled with probabilities proportional to the
weights from `numpy.random.default_rng([seed, k // BLOCK])`: the choices come in
blocks that can be regenerated from the draw count alone, so the mixer's whole
state is one integer. Each draw consumes exactly one raw record of the chosen
source (a malformed one included); a source that runs out starts its next epoch,
in that epoch's order (`Source.records`). (`datasets.interleave_datasets` would mix too, but its
resume state is not exact once a source is exhausted; this mixer's is.)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..errors import DataError
from .sources import Raw, Source

BLOCK = 4096


@dataclass
class Position:
    """Where the mixture stands: draws made, and (epoch, training records read this epoch) per source."""

    draws: int = 0
    epochs: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)

    def copy(self) -> Position:
        return Position(self.draws, list(self.epochs), list(self.index))


class Mixture:
    """Infinite stream of `(source number, Raw, position after it)`."""

    def __init__(self, sources: list[Source], seed: int, position: Position | None = None):
        self.sources = sources
        w = np.array([s.cfg.weight for s in sources], dtype=np.float64)
        self.p = w / w.sum()
        self.seed = seed
        self.pos = position.copy() if position else Position(0, [0] * len(sources), [0] * len(sources))
        if len(self.pos.index) != len(sources):
            raise DataError(f"data state has {len(self.pos.index)} sources, the config has {len(sources)}")

    def _choices(self) -> Iterator[int]:
        k = self.pos.draws
        while True:
            block = np.random.default_rng([self.seed, k // BLOCK]).choice(len(self.sources), BLOCK, p=self.p)
            for c in block[k % BLOCK:].tolist():
                yield c
            k = (k // BLOCK + 1) * BLOCK

    def __iter__(self) -> Iterator[tuple[int, Raw, Position]]:
        pos = self.pos
        readers = [src.records(e, i) for src, e, i in zip(self.sources, pos.epochs, pos.index)]
        for c in self._choices():
            raw = next(readers[c], None)
            if raw is None:  # end of this source's epoch
                if pos.index[c] == 0:
                    raise DataError(f"data source {self.sources[c].name}: no records")
                pos.epochs[c] += 1
                pos.index[c] = 0
                readers[c] = self.sources[c].records(pos.epochs[c], 0)
                raw = next(readers[c], None)
                if raw is None:
                    raise DataError(f"data source {self.sources[c].name}: no records")
            pos.draws += 1
            pos.index[c] += 1
            yield c, raw, pos.copy()


def single_pass(sources: list[Source], held_out: bool) -> Iterator[tuple[int, Raw, None]]:
    """Eval records once, source after source: each training source's held-out ones, or every eval source's."""
    for c, src in enumerate(sources):
        for raw in src.held_out() if held_out else src.everything():
            yield c, raw, None


def progress(sources: list[Source], position: Position | None) -> float | None:
    """Epochs of training data drawn: draws over the training records of all sources (one source: its epoch and the
    fraction of the next read); None when a streamed source's length is unknown."""
    sizes = [s.train_size for s in sources]
    if None in sizes:
        return None
    return (position.draws if position else 0) / max(sum(sizes), 1)
