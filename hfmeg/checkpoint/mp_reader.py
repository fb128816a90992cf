"""Read an MP shard folder: a rank's local tensors, or HF tensors merged on demand.

`MPCheckpoint` offers the same `shape` / `dtype` / `get` by HF name as
`HFCheckpoint`, so the converters treat both as a tensor source: `get` reads the TP
slices of the one rule that produces the name (from the PP rank that owns it) and
merges them with `checkpoint.rules.to_hf`. Outputs of a rule that produces several
HF tensors (q/k/v, gate/up) are kept until each has been asked for once, so a
source never holds more than one rule's tensors. A stacked MoE expert tensor is made
by one rule per expert: `get` merges each expert's slice and stacks them. On opening,
every rank file's names and shapes are checked against what the layout implies.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..config import ModelConfig, load_hf_config, model_config_from_hf
from ..errors import CheckpointError
from .mp_layout import HF_DIR, LAYOUT_FILE, RANK_FILE, MPLayout, resolve_iteration_dir
from .rules import TensorRule, chunk_rules, expected_hf_shape, to_hf, to_local, with_fused_experts
from .st_stream import CODE_DTYPES, read_tensor


def local_shape(rule: TensorRule, cfg: ModelConfig, hf_shapes: list[tuple[int, ...]], tp: int, tp_rank: int,
                vocab_multiple: int) -> tuple[int, ...]:
    """Shape of a TP slice, computed by running `to_local` on meta tensors (no data, no duplicated rules)."""
    metas = [torch.empty(s, device="meta") for s in hf_shapes]
    return tuple(to_local(rule, metas, cfg, tp, tp_rank, vocab_multiple).shape)


def rank_rules(cfg: ModelConfig, layout: MPLayout, pp_rank: int) -> list[TensorRule]:
    """Every tensor of a rank file, in file order (virtual chunks in order, each chunk's rules in order)."""
    return [r for c in layout.rank_chunks(pp_rank) for r in chunk_rules(cfg, c.layers, c.pre_process, c.post_process)]


class MPCheckpoint:
    def __init__(self, mp_dir: str | Path, iteration: int | None = None):
        self.folder = resolve_iteration_dir(mp_dir, iteration)
        self.layout = MPLayout.read(self.folder)
        self.hf_dir = self.folder / HF_DIR
        # How the source stored MoE experts is not in config.json: the layout recorded it at conversion.
        fused = (self.layout.model_config.get("moe") or {}).get("fused_experts", False)
        self.cfg = with_fused_experts(model_config_from_hf(load_hf_config(self.hf_dir)), fused)
        if self.cfg.to_dict() != self.layout.model_config:
            raise CheckpointError(
                f"{self.folder / LAYOUT_FILE}: field model_config disagrees with {self.hf_dir / 'config.json'}"
            )
        self._handles: dict[tuple[int, int], object] = {}
        # HF name -> [(rule, pp rank holding it)]: one rule, or one per expert of a stacked tensor
        self._owner: dict[str, list[tuple[TensorRule, int]]] = {}
        for c in self.layout.chunks:
            for rule in chunk_rules(self.cfg, c.layers, c.pre_process, c.post_process):
                if not rule.tied:
                    for name in rule.hf:
                        self._owner.setdefault(name, []).append((rule, c.pp_rank))
        self._merged: dict[str, torch.Tensor] = {}
        self._check_rank_files()

    # -- rank files -------------------------------------------------------------
    def rank_file(self, tp_rank: int, pp_rank: int) -> Path:
        return self.folder / self.layout.rank_dir(tp_rank, pp_rank) / RANK_FILE

    def _handle(self, tp_rank: int, pp_rank: int):
        key = (tp_rank, pp_rank)
        if key not in self._handles:
            path = self.rank_file(tp_rank, pp_rank)
            if not path.is_file():
                raise CheckpointError(f"{path}: missing rank file")
            try:
                self._handles[key] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{path}: cannot read weights ({type(e).__name__}: {e})") from e
        return self._handles[key]

    def _check_rank_files(self) -> None:
        cfg, L = self.cfg, self.layout
        for p in range(L.pp):
            rules = rank_rules(cfg, L, p)
            for t in range(L.tp):
                path, handle = self.rank_file(t, p), self._handle(t, p)
                names = set(handle.keys())
                want = {r.local for r in rules}
                if names != want:
                    diff = sorted(want - names) or sorted(names - want)
                    what = "lacks" if want - names else "has unexpected"
                    raise CheckpointError(f"{path}: {what} tensor(s) {', '.join(diff[:3])}")
                for rule in rules:
                    hf_shapes = [expected_hf_shape(rule, j, cfg) for j in range(len(rule.hf))]
                    expect = local_shape(rule, cfg, hf_shapes, L.tp, t, L.vocab_multiple)
                    got = tuple(handle.get_slice(rule.local).get_shape())
                    if got != expect:
                        raise CheckpointError(
                            f"{path}: tensor {rule.local} has shape {list(got)}, the layout implies {list(expect)}"
                        )

    def local(self, tp_rank: int, pp_rank: int, name: str) -> torch.Tensor:
        """Tensor `name` of rank file (tp_rank, pp_rank), as stored."""
        self._handle(tp_rank, pp_rank)  # validated on open
        try:
            return read_tensor(self.rank_file(tp_rank, pp_rank), name)
        except (OSError, KeyError) as e:
            path = self.rank_file(tp_rank, pp_rank)
            raise CheckpointError(f"{path}: cannot read tensor {name} ({type(e).__name__}: {e})") from e

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
        metas = [torch.empty(self._handle(t, p).get_slice(rule.local).get_shape(), device="meta")
                 for t in range(self.layout.tp)]
        shape = tuple(to_hf(rule, metas, self.cfg)[name].shape)
        return (len(rules),) + shape if rule.expert is not None else shape

    def dtype(self, name: str) -> torch.dtype:
        rule, p = self._rules(name)[0]
        return CODE_DTYPES[self._handle(0, p).get_slice(rule.local).get_dtype()]

    def _merge(self, rule: TensorRule, p: int) -> dict[str, torch.Tensor]:
        return to_hf(rule, [self.local(t, p, rule.local) for t in range(self.layout.tp)], self.cfg)

    def get(self, name: str) -> torch.Tensor:
        rules = self._rules(name)
        if rules[0][0].expert is not None:  # one slice per expert, in expert order
            return torch.stack([self._merge(rule, p)[name] for rule, p in rules])
        if name not in self._merged:
            self._merged = self._merge(*rules[0])  # drops the previous rule's leftovers
        return self._merged.pop(name)
