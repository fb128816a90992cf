"""The generation batch a GRPO checkpoint keeps when it is taken between the optimizer steps that train on it.

With `steps_per_generation` or `num_iterations` > 1 one generation batch feeds several steps (rollout.py), each
step's importance weights taken against π_old: the batch's log-probabilities under the weights that generated it,
from a forward pass made before the first of those steps moved them. A checkpoint after step k of the batch holds
step k's weights: sampling again from the saved prompt cursor would draw another batch from other weights, and π_old
could not be computed again at all. So the checkpoint keeps the batch, and a resume trains the remaining steps on
exactly what the uninterrupted run trains on:
- `rollout/generation.safetensors` (global rank 0): the batch as rank 0 broadcast it (`Generation`: every
  completion's prompt and completion ids, the generator's log-probabilities, whether it was cut, its advantage,
  whether it is masked; its generation metrics in the metadata);
- `rollout/old_logps_rank_RRRRR.safetensors` (each last-pipeline-stage rank of TP rank 0, the ranks that hold π_old,
  each its DP x CP share): the (completion's index in the batch, the token's position in its own sequence, π_old)
  of every label token it holds.
How many of the batch's `steps x num_iterations` uses the checkpointed steps took is in the trainer state (the data
state, rollout.py). Nothing in the files depends on the layout (a completion's index is its place in the batch, a
position its place in its own sequence), so a resume at another TP, PP, CP or DP size packs the batch for its own
ranks and looks π_old up by (index, position); a resharded checkpoint carries the folder as it is
(reshard_checkpoint.py). The files are written inside the checkpoint's staged folder (checkpointing.py): committed
with it, or not at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..checkpoint.atomic import save_tensors
from ..data.rollouts import Completion, completion_tensors, completions_of
from ..errors import CheckpointError, LayoutError
from .checkpointing import ROLLOUT_DIR

GENERATION_FILE = "generation.safetensors"


@dataclass
class Generation:
    """A generation batch as rank 0 made it: its completions in order (groups of `num_generations`), their
    advantages `[N]`, which train on no token (`mask_truncated_completions`; None: none) and its metrics."""

    completions: list[Completion]
    advantages: torch.Tensor
    masked: list[bool] | None
    metrics: dict[str, float]


def old_logps_file(rank: int) -> str:
    return f"old_logps_rank_{rank:05d}.safetensors"


OLD_LOGPS_FILES = "old_logps_rank_*.safetensors"


def save(folder: Path, ps, generation: Generation, batches: list) -> None:
    """Every rank, into a checkpoint's staged `folder`: its part of the held generation batch (module doc);
    `batches`: this rank's packed steps of it (`rollout.RolloutBatch`), π_old filled on the last stage."""
    out = folder / ROLLOUT_DIR
    out.mkdir(exist_ok=True)
    if ps.rank == 0:
        tensors = {**completion_tensors(generation.completions), "advantages": generation.advantages.cpu()}
        if generation.masked is not None:
            tensors["masked"] = torch.tensor(generation.masked, dtype=torch.bool)
        save_tensors(tensors, out / GENERATION_FILE, {"metrics": json.dumps(generation.metrics)})
    if ps.is_last_stage and ps.tp_rank == 0:
        held = [(index[kept], mb.position_ids[kept].cpu(), mb.old_logps.cpu()[kept])
                for _, index, kept, mb in _tokens(batches, ps)]
        save_tensors({name: torch.cat(parts) for name, parts in zip(("index", "position", "old_logps"), zip(*held))},
                     out / old_logps_file(ps.rank), {})


def load(folder: Path) -> tuple[Generation, torch.Tensor]:
    """The generation batch a checkpoint holds (`save`), and π_old as a table `[completion, position]` (NaN where no
    file held one). CheckpointError naming the file for what is missing or unreadable."""
    where = folder / ROLLOUT_DIR
    tensors, meta = _read(where / GENERATION_FILE)
    try:
        completions = completions_of(tensors)
        metrics = json.loads(meta["metrics"])
    except (LayoutError, KeyError, ValueError) as e:
        raise CheckpointError(f"{where / GENERATION_FILE}: not a generation batch ({e})") from e
    masked = tensors["masked"].tolist() if "masked" in tensors else None
    generation = Generation(completions, tensors["advantages"], masked, metrics)
    longest = max(len(c.prompt_ids) + len(c.completion_ids) for c in completions)
    table = torch.full((len(completions), longest), float("nan"))
    files = sorted(where.glob(OLD_LOGPS_FILES))
    if not files:
        raise CheckpointError(f"{where}: no {OLD_LOGPS_FILES} (the batch's π_old)")
    for path in files:
        held, _ = _read(path)
        index, position = held["index"], held["position"]
        if len(index) and (index.max() >= len(completions) or position.max() >= longest):
            raise CheckpointError(f"{path}: π_old of tokens outside {where / GENERATION_FILE}'s completions")
        table[index, position] = held["old_logps"]
    return generation, table


def restore_old_logps(batches: list, ps, table: torch.Tensor, folder: Path) -> list:
    """`batches` (this rank's packed steps of the loaded generation batch) with π_old from `table` (`load`) on the
    last pipeline stage, where the forward that made it put it; CheckpointError if the table lacks a token's."""
    if not ps.is_last_stage:
        return batches
    filled: list[list] = [[] for _ in batches]
    for step, index, kept, mb in _tokens(batches, ps):
        old = torch.zeros(kept.shape, dtype=torch.float32)
        old[kept] = table[index[kept], mb.position_ids[kept]]
        if old.isnan().any():
            raise CheckpointError(f"{folder / ROLLOUT_DIR}: no π_old saved for some tokens of completions "
                                  f"{sorted(set(index[old.isnan()].tolist()))[:4]} (a file is missing)")
        filled[step].append(replace(mb, old_logps=old))
    return [replace(b, microbatches=mbs) for b, mbs in zip(batches, filled, strict=True)]


def _tokens(batches: list, ps) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, object]]:
    """(step, each token's completion index in the generation batch `[b, s]`, whether its label counts `[b, s]`,
    micro-batch) of this rank's held micro-batches: step s's global batch is completions s·n.., this DP rank's
    share the dp_rank-th n / dp of it, and micro-batch m of the share its m-th run of completions
    (rollout.py's `_pack_step`, `data/rollouts.py`'s `pack_completions`)."""
    for step, batch in enumerate(batches):
        n = batch.num_completions
        first = step * n + ps.dp_rank * (n // ps.dp)
        for mb in batch.microbatches:
            ids = mb.sequence_ids.cpu()
            yield step, first + ids.clamp(min=0), ids >= 0, mb
            first += mb.num_completions


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); the checkpoint's held generation batch "
                              "(resume from an earlier checkpoint with --resume PATH)") from e
