"""A run's live shards as an HF tensor source, on global rank 0, with no file written: the weight push of online RL.

Every rank gives what it would write into its checkpoint folder (`mp_save.shard_tensors`: DP rank 0's tensors,
the other EP ranks' experts), under the same stored names; `parallel.gather_named` brings them to rank 0, and
`LiveShards` is the `ShardView` (mp_reader.py) over them: `get(name)` merges a tensor's TP slices by its rule
(`rules.to_hf`) as `MPCheckpoint` does from the rank files, so the HF names, the layout and the merge have one
owner. Its tensors feed the HF exporter (`hf_writer.write_hf_folder`: an HF folder in shared memory for vLLM)
or are copied straight into an in-process model (`exported_names` gives the names the export would write).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..models.decoder import ModelChunk
from ..parallel.gather_named import gather_named
from ..parallel.state import ParallelState
from .mp_layout import MPLayout
from .mp_reader import ShardView
from .mp_save import shard_tensors


class LiveShards(ShardView):
    """The gathered shards: {(tp rank, pp rank): {stored name: tensor}}, of the run `cfg` laid out as `layout`,
    its side files (config, tokenizer, carried tensors) in `hf_dir`."""

    def __init__(self, cfg, layout: MPLayout, hf_dir: Path, shards: dict[tuple[int, int], dict[str, torch.Tensor]]):
        self.folder = f"the live shards ({layout.tp} x {layout.pp})"  # what an error names
        self._view(cfg, layout, Path(hf_dir))
        self.shards = shards

    def local(self, tp_rank: int, pp_rank: int, name: str) -> torch.Tensor:
        return self.shards[tp_rank, pp_rank][name]

    def local_shape(self, tp_rank: int, pp_rank: int, name: str) -> tuple[int, ...]:
        return tuple(self.shards[tp_rank, pp_rank][name].shape)

    def local_dtype(self, tp_rank: int, pp_rank: int, name: str) -> torch.dtype:
        return self.shards[tp_rank, pp_rank][name].dtype


def live_shards(chunks: list[ModelChunk], ps: ParallelState, layout: MPLayout, hf_dir: Path) -> LiveShards | None:
    """Collective: the chunks' shards on rank 0 (None elsewhere). `layout`: `mp_save.chunks_layout` of the chunks;
    `hf_dir`: the run's HF side files."""
    mine = shard_tensors(chunks, ps, layout)
    gathered = gather_named(mine, (ps.tp_rank, ps.pp_rank) if mine else None, ps.device)
    if gathered is None:
        return None
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for place, tensors in gathered:
        shards.setdefault(place, {}).update(tensors)  # an EP group's ranks fill one rank folder together
    return LiveShards(chunks[0].cfg, layout, hf_dir, shards)
