"""Split kinds: how one full tensor is cut into the pieces that ranks (or experts) hold, as objects.

A split kind answers three questions and nothing else: `shard(full, n, i)`: piece `i` of `n`; `join(pieces)`:
the full tensor from all `n` pieces, in order (the inverse of `shard`); `full_shape(local, n)`: the full shape of
a tensor whose piece has shape `local`. Everything that needs to know how a tensor is split reads its kind:
conversion (`checkpoint/rules.py`: one kind per `TensorRule`), adapter slicing (`peft/adapters.py`: a LoRA
factor's kind is derived from its base's), the adapter layout shapes (`peft/layout_shards.py`) and the adapter
shard files (a kind's `record`). All of them are pure data movement (chunk, cat, reshape, pad), so shard then join
gives back every bit.

Kinds:
- `Replicated`: whole on every rank (norms, biases after a reduction, a replicated linear's weight).
- `Dim(d)`: equal contiguous ranges of dim `d` (`ROWS`: a column-parallel weight's output features; `COLS`: a
  row-parallel weight's input features; `EXPERT_ROWS`: expert e's `[r, in]` block of peft's `[E r, in]` stack;
  `EXPERTS`: an expert-parallel rank's contiguous block of a stack's experts, `expert_dispatch.local_experts`).
- `Strided(d)`: the entries of dim `d` whose index is `i` modulo `n` (peft's expert `lora_B` `[out, r E]`, whose
  column `k E + e` is expert e's column k).
- `Vocab(rows, multiple)`: the rows padded with zeros to `padded_vocab(rows, n, multiple)`, then `ROWS`.
- `Fused(sizes, groups)`: a fused tensor `[part 0; part 1; ...]` of rows `sizes` (QKV, gate/up, Gated DeltaNet's
  in_proj), laid out as Megatron holds it: each part cut into `groups` blocks (None: one per rank) and
  `[part 0 block b; part 1 block b; ...]` for each b (`Blocks.interleave`), then `ROWS`. So rank r of a fused
  gate/up holds `[gate_r; up_r]`, and rank r of a QKV fused per KV group (`groups` = the KV heads) holds
  `[q heads of g; k_g; v_g]` for its groups g. With fewer groups than ranks (KV heads replicated over TP, as
  Megatron-Core does), the `n / groups` ranks of group g each hold their share of the first `divided` parts' block
  (the q rows: 1) and a copy of the others' (`[their q heads of g; k_g; v_g]`); joining takes the copies from the
  group's first rank. `select(parts)` is the kind of a tensor made of some parts only, laid out alike (a LoRA B over
  q_proj, over k_proj alone: all of a rank's rows copies, `divided` 0; or over Phi-3's whole `qkv_proj`). `copies`
  says which of a rank's rows are copies, for the role of the parameter holding them (`ParamRole.shared_rows`: their
  gradients summed over the holders, counted once).

Adding a kind is one class here plus its case in `tests/test_splits.py` (shard/join round trip at n = 1, 2, 4,
`full_shape` inverting the piece's shape and `local_shape` giving it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import padded_vocab


@dataclass(frozen=True)
class Blocks:
    """The rows of `[part 0; part 1; ...]` (`sizes`) cut into `n` blocks per part, reordered block-major:
    `[part 0 block b; part 1 block b; ...]` for each b. Also an HF tensor's own layout where a checkpoint holds its
    parts that way (gpt-oss's alternating gate/up rows: n = rows per part; Qwen3-Next's per-key-head groups)."""

    n: int
    sizes: tuple[int, ...]

    def interleave(self, t: torch.Tensor) -> torch.Tensor:
        """`[part 0; part 1; ...]` -> block-major."""
        parts = t.split(list(self.sizes))
        return torch.cat([p.unflatten(0, (self.n, -1)) for p in parts], dim=1).flatten(0, 1)

    def deinterleave(self, t: torch.Tensor) -> torch.Tensor:
        """Block-major -> `[part 0; part 1; ...]`."""
        parts = t.unflatten(0, (self.n, -1)).split([s // self.n for s in self.sizes], dim=1)
        return torch.cat([p.flatten(0, 1) for p in parts])


class Split:
    """A split kind (see the module docstring). `name` and `record` are its form in adapter shard files; `tp_dim`
    the dim whose ranges ranks hold (None: whole), as a parameter's `ParamRole.tp_dim` must say."""

    name: str
    tp_dim: int | None = 0

    def shard(self, full: torch.Tensor, parts: int, index: int) -> torch.Tensor:
        raise NotImplementedError

    def join(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def full_shape(self, local: tuple[int, ...], parts: int) -> tuple[int, ...]:
        raise NotImplementedError

    def local_shape(self, full: tuple[int, ...], parts: int) -> tuple[int, ...]:
        """The shape of each of `parts` pieces of a tensor of shape `full` (`full_shape`'s inverse)."""
        raise NotImplementedError

    def copies(self, parts: int) -> tuple[int, int]:
        """(n, k): the last n rows of each piece are a copy that k consecutive ranks hold (0, 1: none)."""
        return 0, 1

    def record(self, parts: int) -> tuple[str, int | None, list | None]:
        """(kind name, vocabulary rows, blocks): what an adapter shard file stores to join its tensors again."""
        return self.name, None, None


@dataclass(frozen=True)
class Replicated(Split):
    name = "replicated"
    tp_dim = None

    def shard(self, full, parts, index):
        return full

    def join(self, pieces):
        return pieces[0]

    def full_shape(self, local, parts):
        return tuple(local)

    def local_shape(self, full, parts):
        return tuple(full)


@dataclass(frozen=True)
class Dim(Split):
    dim: int
    name: str = "rows"

    @property
    def tp_dim(self) -> int:
        return self.dim

    def shard(self, full, parts, index):
        return full.chunk(parts, dim=self.dim)[index]

    def join(self, pieces):
        return torch.cat(pieces, dim=self.dim)

    def full_shape(self, local, parts):
        shape = list(local)
        shape[self.dim] *= parts
        return tuple(shape)

    def local_shape(self, full, parts):
        shape = list(full)
        shape[self.dim] //= parts
        return tuple(shape)


@dataclass(frozen=True)
class Strided(Dim):
    def shard(self, full, parts, index):
        return full.unflatten(self.dim, (-1, parts)).select(self.dim + 1, index)

    def join(self, pieces):
        return torch.stack(pieces, dim=self.dim + 1).flatten(self.dim, self.dim + 1)


@dataclass(frozen=True)
class Vocab(Split):
    rows: int
    multiple: int | None = None  # needed to shard (the padded size); joining only drops the padding
    name = "vocab"

    def shard(self, full, parts, index):
        pad = padded_vocab(self.rows, parts, self.multiple) - full.shape[0]
        padded = torch.cat([full, full.new_zeros(pad, *full.shape[1:])]) if pad else full
        return ROWS.shard(padded, parts, index)

    def join(self, pieces):
        return torch.cat(pieces, dim=0)[: self.rows]

    def full_shape(self, local, parts):
        return (self.rows, *local[1:])

    def local_shape(self, full, parts):
        return (padded_vocab(self.rows, parts, self.multiple) // parts, *full[1:])

    def record(self, parts):
        return self.name, self.rows, None


@dataclass(frozen=True)
class Fused(Split):
    sizes: tuple[int, ...]
    groups: int | None = None  # blocks per part; None: one per rank
    divided: int = 1  # the leading parts a replicated group's holders divide; each holds a copy of the others
    name = "rows"

    def blocks(self, parts: int) -> Blocks:
        return Blocks(self.groups or parts, self.sizes)

    def replicas(self, parts: int) -> int:
        """How many ranks share each group (1 unless there are fewer groups than ranks)."""
        return max(1, parts // (self.groups or parts))

    def local_groups(self, parts: int) -> int:
        """The blocks of each part a rank holds."""
        return max(1, (self.groups or parts) // parts)

    def _rows(self) -> tuple[int, int]:
        """A group's block's rows: (of the divided parts, of the copied ones)."""
        return sum(self.sizes[: self.divided]) // self.groups, sum(self.sizes[self.divided:]) // self.groups

    def shard(self, full, parts, index):
        n = self.replicas(parts)
        laid = self.blocks(parts).interleave(full)
        if n == 1:
            return ROWS.shard(laid, parts, index)
        block = laid.chunk(self.groups, dim=0)[index // n]  # [part 0 block g; part 1 block g; ...]
        divided, copied = block.split(self._rows())
        return torch.cat([divided.tensor_split(n, dim=0)[index % n], copied])  # (n pieces even when empty)

    def join(self, pieces):
        n = self.replicas(len(pieces))
        if n == 1:
            return self.blocks(len(pieces)).deinterleave(torch.cat(pieces))
        copied = self._rows()[1]
        blocks = []
        for g in range(self.groups):
            holders = pieces[g * n: (g + 1) * n]
            blocks += [p[: p.shape[0] - copied] for p in holders] + [holders[0][holders[0].shape[0] - copied:]]
        return self.blocks(len(pieces)).deinterleave(torch.cat(blocks))

    def full_shape(self, local, parts):
        return (sum(self.sizes), *local[1:])

    def local_shape(self, full, parts):
        return (self.local_rows(parts), *full[1:])

    def local_rows(self, parts: int) -> int:
        """A rank's rows (each holder of a replicated group counts its copy)."""
        n = self.replicas(parts)
        return self._rows()[0] // n + self._rows()[1] if n > 1 else sum(self.sizes) // parts

    def copies(self, parts):
        n = self.replicas(parts)
        return (self._rows()[1], n) if n > 1 else (0, 1)

    def select(self, parts: tuple[int, ...]) -> Split:
        """The kind of a tensor made of the parts `parts` only (indices), laid out like these (one part that no
        group's holders hold copies of: `ROWS`)."""
        divided = sum(p < self.divided for p in parts)
        if len(parts) == 1 and (divided or self.groups is None):
            return ROWS
        return Fused(tuple(self.sizes[p] for p in parts), self.groups, divided)

    def record(self, parts):
        if len(self.sizes) == 1 and self.replicas(parts) == 1:  # a single part, no copies: it joins as rows
            return ROWS.record(parts)
        return self.name, None, [self.groups or parts, list(self.sizes)] + ([self.divided] if self.divided != 1 else [])


REPLICATED = Replicated()
ROWS = Dim(0)
COLS = Dim(1, "cols")
EXPERT_ROWS = Dim(0, "expert_A")
EXPERT_COLS = Strided(1, "expert_B")
EXPERTS = Dim(0, "experts")  # over EP, not TP: a stack `[E, ...]` (or its rows `[E rows, ...]`), E / ep experts a rank
_NAMED = {s.name: s for s in (REPLICATED, ROWS, COLS, EXPERT_ROWS, EXPERT_COLS, EXPERTS)}


def from_record(name: str, rows: int | None = None, blocks: list | None = None) -> Split:
    """The kind an adapter shard file's `record` names (`Split.record`)."""
    if blocks is not None:
        return Fused(tuple(blocks[1]), blocks[0], *blocks[2:])
    return Vocab(rows) if name == Vocab.name else _NAMED[name]
