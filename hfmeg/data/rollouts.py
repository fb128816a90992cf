"""`CompletionBatch`: completions of prompts (online RL, GRPO family) as rows of a micro-batch, and how to pack them.

A GRPO step trains on groups of completions: each prompt is sampled `num_generations` times, each
completion is scored, and the scores become advantages within the prompt's group (train/grpo.py).
Here a completion is a sequence `prompt + completion`, one document of a row, exactly as a preference
pair's answer is (`PairBatch`): packed several to a row with document ids and positions, only the
completion's tokens labelled. `sequence_ids` say which completion each label token belongs to, so the
loss can take per-completion sums (the token count of a completion, GSPO's sequence log-ratio) under CP
as under one rank. The per-token log-probabilities the loss compares against (the policy that generated
the completion, the reference) are per-token fields: staging, the CP split and the pipeline move and cut
them with the tokens, and they sit at the label's position (the log-probability of the label token).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..errors import LayoutError
from .formats import Doc
from .microbatch import PER_SEQUENCE, PER_TOKEN, MicroBatch
from .packing import IGNORE, build_row


@dataclass(frozen=True, kw_only=True)
class CompletionBatch(MicroBatch):
    """`num_completions` prompt + completion sequences, as rows (see the module doc).

    `sequence_ids` `[b, s]`: the completion each counted label token belongs to (-1 elsewhere).
    `old_logps`, `ref_logps` `[b, s]` float32: the log-probability of each label token under the policy
    before this step's updates (GRPO's π_old; None: the policy itself, detached, as TRL has it when
    `num_iterations` is 1) and under the reference (None: no KL term), 0 where no label counts; `gen_logps`
    likewise the generating engine's (for the train/generation mismatch metric; None: not given).
    `advantages` `[num_completions]` float32: each completion's advantage within its group."""

    num_completions: int
    sequence_ids: torch.Tensor = field(metadata=PER_TOKEN)
    advantages: torch.Tensor = field(metadata=PER_SEQUENCE)
    old_logps: torch.Tensor | None = field(default=None, metadata=PER_TOKEN)
    ref_logps: torch.Tensor | None = field(default=None, metadata=PER_TOKEN)
    gen_logps: torch.Tensor | None = field(default=None, metadata=PER_TOKEN)

    def _check_sequences(self) -> None:
        if self.num_completions < 0:
            raise LayoutError(f"completion micro-batch: {self.num_completions} completions")
        for f, t in self._tensors_of("sequence"):
            if t.shape[0] != self.num_completions:
                raise LayoutError(f"completion micro-batch {f}: {t.shape[0]} entries, not {self.num_completions} "
                                  "completions")


@dataclass(frozen=True)
class Completion:
    """One sampled completion: the prompt's token ids, the completion's, and (where the engine gives them)
    the generator's log-probability of each completion token; `truncated`: it ended at the length limit,
    not at an end-of-sequence token."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logps: list[float] | None = None
    truncated: bool = False


def pack_completions(completions: list[Completion], advantages: torch.Tensor, per_row: int, seq_len: int,
                     pad_id: int, rows: int = 1, masked: list[bool] | None = None) -> list[CompletionBatch]:
    """Micro-batches of `rows` rows each, `per_row` completions packed per row as documents, in order (completion
    k of a micro-batch is its k-th). Where the completions carry the generator's log-probabilities, they become
    `gen_logps`.

    `masked[i]`: completion i trains on no token (TRL's `mask_truncated_completions`), yet it still counts
    as a completion (the loss's mean over completions includes it, as TRL's does)."""
    per_mb = per_row * rows
    if len(completions) % per_mb:
        raise LayoutError(f"{len(completions)} completions do not fill micro-batches of {rows} rows x {per_row}")
    out = []
    for lo in range(0, len(completions), per_mb):
        built = []
        for r in range(lo, lo + per_mb, per_row):
            docs = []
            for i in range(r, r + per_row):
                c = completions[i]
                ids = np.array(c.prompt_ids + c.completion_ids)
                mask = np.zeros(len(ids), dtype=bool)
                if not (masked and masked[i]):
                    mask[len(c.prompt_ids):] = True
                docs.append(Doc(ids, mask))
            if sum(len(d.ids) for d in docs) > seq_len:
                raise LayoutError(f"{per_row} completion(s) of {sum(len(d.ids) for d in docs)} tokens do not fit a "
                                  f"row of data.seq_len {seq_len}")
            row = build_row(docs, seq_len, pad_id)
            # documents 1.. of the row -> completions (r - lo).. of the micro-batch
            row["sequence_ids"] = np.where(row["labels"] != IGNORE, row["segment_ids"] - 1 + (r - lo), -1)
            built.append(row)
        fields = {k: torch.from_numpy(np.stack([b[k] for b in built])) for k in built[0]}
        mb = CompletionBatch(num_completions=per_mb, advantages=advantages[lo:lo + per_mb].float(), **fields)
        group = completions[lo:lo + per_mb]
        if all(c.logps is not None for c in group):
            mb = replace(mb, gen_logps=token_values(mb, [c.logps if not (masked and masked[lo + k]) else []
                                                         for k, c in enumerate(group)]))
        out.append(mb)
    return out


def token_values(mb: CompletionBatch, per_completion: list[list[float]]) -> torch.Tensor:
    """Per-completion-token values (a log-probability of each completion token, in order) laid out as `mb`'s
    labels are: `[b, s]` float32, each value at its token's label position, 0 where no label counts."""
    out = torch.zeros(mb.labels.shape, dtype=torch.float32)
    ids = mb.sequence_ids
    for k in range(mb.num_completions):
        where = (ids == k).nonzero(as_tuple=True)
        values = per_completion[k]
        if len(values) != len(where[0]):
            raise LayoutError(f"completion {k}: {len(values)} values for {len(where[0])} label tokens")
        out[where] = torch.tensor(values, dtype=torch.float32)
    return out


def completion_tensors(completions: list[Completion]) -> dict[str, torch.Tensor]:
    """`completions` as flat tensors, for a safetensors file (`completions_of` reads them back, equal): each one's
    prompt and completion ids concatenated with their lengths, whether it was cut, and the generator's
    log-probabilities (float64: the engine's Python floats as they were) of those that carry them."""
    def ids(lists: list[list[int]]) -> torch.Tensor:
        return torch.tensor([i for ids in lists for i in ids], dtype=torch.int64)

    with_logps = [c.logps for c in completions if c.logps is not None]
    return {"prompt_ids": ids([c.prompt_ids for c in completions]),
            "prompt_lengths": torch.tensor([len(c.prompt_ids) for c in completions], dtype=torch.int64),
            "completion_ids": ids([c.completion_ids for c in completions]),
            "completion_lengths": torch.tensor([len(c.completion_ids) for c in completions], dtype=torch.int64),
            "truncated": torch.tensor([c.truncated for c in completions], dtype=torch.bool),
            "has_logps": torch.tensor([c.logps is not None for c in completions], dtype=torch.bool),
            "logps": torch.tensor([v for logps in with_logps for v in logps], dtype=torch.float64)}


def completions_of(tensors: dict[str, torch.Tensor]) -> list[Completion]:
    """The completions `completion_tensors` flattened (LayoutError where the lengths do not add up)."""
    prompt_lengths, lengths = tensors["prompt_lengths"].tolist(), tensors["completion_lengths"].tolist()
    has_logps = tensors["has_logps"].tolist()
    if (sum(prompt_lengths) != tensors["prompt_ids"].numel() or sum(lengths) != tensors["completion_ids"].numel()
            or sum(n for n, has in zip(lengths, has_logps) if has) != tensors["logps"].numel()):
        raise LayoutError("completion tensors: the lengths do not add up to the ids and log-probabilities held")
    prompts = tensors["prompt_ids"].split(prompt_lengths)
    completions = tensors["completion_ids"].split(lengths)
    logps = iter(tensors["logps"].split([n for n, has in zip(lengths, has_logps) if has]))
    return [Completion(p.tolist(), c.tolist(), next(logps).tolist() if has else None, bool(cut))
            for p, c, has, cut in zip(prompts, completions, has_logps, tensors["truncated"].tolist(), strict=True)]
