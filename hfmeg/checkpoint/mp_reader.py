"""Read an MP shard folder: a rank's local tensors, or HF tensors merged on demand.

`MPCheckpoint` offers the same `shape` / `dtype` / `get` by HF name as
`HFCheckpoint`, so the converters treat both as a tensor source: `get` reads the TP
slices of the one rule that produces the name (from the PP rank that owns it) and
merges them with `checkpoint.rules.to_hf`. Outputs of a rule that produces several
HF tensors (q/k/v, gate/up) are kept until each has been asked for once, so a
source never holds more than one rule's tensors. A stacked MoE expert tensor is made
by one rule per expert: `get` merges each expert's slice and stacks them. That HF view is
`ShardView`'s, whatever holds the slices: `MPCheckpoint` reads them from the rank files,
`live_shards.LiveShards` from a run's shards gathered in memory. A rank folder
may hold several weight files (an expert-parallel save, `mp_layout.rank_files`): tensors
are found by name across them. On opening, every rank folder's names (each exactly once)
and shapes are checked against what the layout implies.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import ModelConfig, load_hf_config
from ..families import model_config_from_hf
from ..errors import CheckpointError
from ..families.spec import TensorRule
from .placement import as_saved
from .mp_layout import HF_DIR, LAYOUT_FILE, MPLayout, rank_files, resolve_iteration_dir
from .rules import chunk_rules, expected_hf_shape, hf_shape, to_hf, to_local, with_fused_experts
from .st_stream import CODE_DTYPES, read_tensor


def local_shape(rule: TensorRule, cfg: ModelConfig, hf_shapes: list[tuple[int, ...]], tp: int, tp_rank: int,
                vocab_multiple: int) -> tuple[int, ...]:
    """Shape of a TP slice, computed by running `to_local` on meta tensors (no data, no duplicated rules)."""
    metas = [torch.empty(s, device="meta") for s in hf_shapes]
    return tuple(to_local(rule, metas, cfg, tp, tp_rank, vocab_multiple).shape)


def rank_rules(cfg: ModelConfig, layout: MPLayout, pp_rank: int) -> list[TensorRule]:
    """Every tensor of a rank file, in file order (virtual chunks in order, each chunk's rules in order)."""
    return [r for c in layout.rank_chunks(pp_rank) for r in chunk_rules(cfg, c.layers, c.pre_process, c.post_process)]


class ShardView(ABC):
    """The HF view of a model's TP x PP shards: `shape` / `dtype` / `get` by HF name, each tensor merged from its TP
    slices by its rule (`rules.to_hf`) on demand (see the module docstring). Where the slices are is the subclass's:
    `local(tp_rank, pp_rank, name)` and its shape and dtype (`local_shape`, `local_dtype`); `hf_dir` holds the side
    files (config, tokenizer, carried tensors) the exporter copies."""

    def _view(self, cfg: ModelConfig, layout: MPLayout, hf_dir: Path) -> None:
        self.cfg, self.layout, self.hf_dir = cfg, layout, hf_dir
        # HF name -> [(rule, pp rank holding it)]: one rule, or one per expert of a stacked tensor
        self._owner: dict[str, list[tuple[TensorRule, int]]] = {}
        for c in self.layout.chunks:
            for rule in chunk_rules(self.cfg, c.layers, c.pre_process, c.post_process):
                if not rule.tied:
                    for name in rule.hf:
                        self._owner.setdefault(name, []).append((rule, c.pp_rank))
        self._merged: dict[str, torch.Tensor] = {}

    @abstractmethod
    def local(self, tp_rank: int, pp_rank: int, name: str) -> torch.Tensor:
        """Tensor `name` of rank (tp_rank, pp_rank)'s shard, as stored."""

    @abstractmethod
    def local_shape(self, tp_rank: int, pp_rank: int, name: str) -> tuple[int, ...]:
        """Its shape, without its data."""

    @abstractmethod
    def local_dtype(self, tp_rank: int, pp_rank: int, name: str) -> torch.dtype:
        """Its dtype, without its data."""

    # -- HF view ----------------------------------------------------------------
    def hf_names(self) -> list[str]:
        """Every HF tensor the checkpoint holds, in model order."""
        return list(self._owner)

    def _rules(self, name: str) -> list[tuple[TensorRule, int]]:
        if name not in self._owner:
            raise CheckpointError(f"{self.folder}: tensor {name} is not in the checkpoint")
        return self._owner[name]

    def __contains__(self, name: str) -> bool:
        return name in self._owner

    def shape(self, name: str) -> tuple[int, ...]:
        rules = self._rules(name)
        rule, p = rules[0]
        shape = hf_shape(rule, name, self.local_shape(0, p, rule.local), self.layout.tp, self.cfg)
        return (len(rules),) + shape if rule.expert is not None else shape

    def dtype(self, name: str) -> torch.dtype:
        rule, p = self._rules(name)[0]
        return self.local_dtype(0, p, rule.local)

    def _merge(self, rule: TensorRule, p: int) -> dict[str, torch.Tensor]:
        return to_hf(rule, [self.local(t, p, rule.local) for t in range(self.layout.tp)], self.cfg)

    def get(self, name: str) -> torch.Tensor:
        rules = self._rules(name)
        if rules[0][0].expert is not None:  # one slice per expert, in expert order
            return torch.stack([self._merge(rule, p)[name] for rule, p in rules])
        if name not in self._merged:
            self._merged = self._merge(*rules[0])  # drops the previous rule's leftovers
        return self._merged.pop(name)


class MPCheckpoint(ShardView):
    """The shards of an MP folder (`iteration`: which of its iterations, default the latest)."""

    def __init__(self, mp_dir: str | Path, iteration: int | None = None):
        self.folder = resolve_iteration_dir(mp_dir, iteration)
        layout = MPLayout.read(self.folder)
        hf_dir = self.folder / HF_DIR
        # How the source stored MoE experts is not in config.json: the layout recorded it at conversion.
        fused = (layout.model_config.get("moe") or {}).get("fused_experts", False)
        cfg = as_saved(with_fused_experts(model_config_from_hf(load_hf_config(hf_dir)), fused), layout.model_config)
        if cfg.to_dict() != layout.model_config:
            raise CheckpointError(
                f"{self.folder / LAYOUT_FILE}: field model_config disagrees with {hf_dir / 'config.json'}"
            )
        self._view(cfg, layout, hf_dir)
        self._files: dict[tuple[int, int], dict[str, tuple[Path, object]]] = {}
        self._check_rank_files()

    # -- rank files -------------------------------------------------------------
    def rank_dir(self, tp_rank: int, pp_rank: int) -> Path:
        return self.folder / self.layout.rank_dir(tp_rank, pp_rank)

    def _tensors(self, tp_rank: int, pp_rank: int) -> dict[str, tuple[Path, object]]:
        """Tensor name -> (file, open handle) over the weight files of rank folder (tp_rank, pp_rank)."""
        key = (tp_rank, pp_rank)
        if key not in self._files:
            found: dict[str, tuple[Path, object]] = {}
            for path in rank_files(self.rank_dir(tp_rank, pp_rank)):
                if not path.is_file():
                    raise CheckpointError(f"{path}: missing rank file")
                try:
                    handle = safe_open(str(path), framework="pt")
                except (SafetensorError, OSError) as e:
                    raise CheckpointError(f"{path}: cannot read weights ({type(e).__name__}: {e})") from e
                for name in handle.keys():
                    if name in found:
                        raise CheckpointError(f"{path}: tensor {name} is also in {found[name][0].name}")
                    found[name] = (path, handle)
            self._files[key] = found
        return self._files[key]

    def local_slice(self, tp_rank: int, pp_rank: int, name: str):
        """safetensors' lazy slice of tensor `name` of rank folder (tp_rank, pp_rank): shape and dtype, no data."""
        _, handle = self._tensors(tp_rank, pp_rank)[name]
        return handle.get_slice(name)

    def _check_rank_files(self) -> None:
        cfg, L = self.cfg, self.layout
        L.check_rank_dirs(self.folder)
        for p in range(L.pp):
            rules = rank_rules(cfg, L, p)
            for t in range(L.tp):
                where, names = self.rank_dir(t, p), set(self._tensors(t, p))
                want = {r.local for r in rules}
                if names != want:
                    diff = sorted(want - names) or sorted(names - want)
                    what = "lacks" if want - names else "has unexpected"
                    raise CheckpointError(f"{where}: {what} tensor(s) {', '.join(diff[:3])}")
                for rule in rules:
                    hf_shapes = [expected_hf_shape(rule, j, cfg) for j in range(len(rule.hf))]
                    expect = local_shape(rule, cfg, hf_shapes, L.tp, t, L.vocab_multiple)
                    got = tuple(self.local_slice(t, p, rule.local).get_shape())
                    if got != expect:
                        path = self._tensors(t, p)[rule.local][0]
                        raise CheckpointError(
                            f"{path}: tensor {rule.local} has shape {list(got)}, the layout implies {list(expect)}"
                        )

    def holder(self, pp_rank: int, name: str) -> int:
        """The pipeline rank whose folder holds tensor `name`: `pp_rank` where it does (a run's own chunks), else
        the one that does (a prefix gathered from several stages, `load.load_prefix`)."""
        ranks = [pp_rank] + [r for r in range(self.layout.pp) if r != pp_rank]
        return next((r for r in ranks if name in self._tensors(0, r)), pp_rank)

    def local(self, tp_rank: int, pp_rank: int, name: str) -> torch.Tensor:
        """Tensor `name` of rank folder (tp_rank, pp_rank), as stored."""
        path, _ = self._tensors(tp_rank, pp_rank)[name]  # validated on open
        try:
            return read_tensor(path, name)
        except (OSError, KeyError) as e:
            raise CheckpointError(f"{path}: cannot read tensor {name} ({type(e).__name__}: {e})") from e

    def local_shape(self, tp_rank: int, pp_rank: int, name: str) -> tuple[int, ...]:
        return tuple(self.local_slice(tp_rank, pp_rank, name).get_shape())

    def local_dtype(self, tp_rank: int, pp_rank: int, name: str) -> torch.dtype:
        return CODE_DTYPES[self.local_slice(tp_rank, pp_rank, name).get_dtype()]
