"""GRPO's weight push without files (train/rollout.py): the live shards gathered on rank 0 in memory
(`checkpoint/live_shards.py`, a LoRA run's adapters `peft.adapter_files.live_adapters`) give exactly what the file
path gave, the shards written as a checkpoint and exported (`ModelPart.export`), at one process and at TP2 x PP2,
full fine-tuning and LoRA:
- `export_live`'s HF folder (what vLLM reloads, and what builds the in-process engine) holds the file path's
  export's tensors bit for bit;
- after `live_weights` are copied into an in-process transformers engine built from an earlier push, its state
  dict is bit-equal to that of an engine built from the file path's export of the new weights.
Pure data movement and the same merge arithmetic on both paths, so equality is exact, not a bound.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch
from helpers import make_ps, stories_or_skip

from hfmeg.parallel.launch import spawn

LORA = dict(method="lora", r=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"])


def _perturb(chunks, step: int) -> None:
    """Moves every trained tensor by seeded noise, the same for a tensor's TP replicas (seeded by name and step)."""
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if p.requires_grad:
                    g = torch.Generator().manual_seed(zlib.crc32(f"{step}:{name}".encode()))
                    p.add_(0.05 * torch.randn(p.shape, generator=g))


def _file_path(part, chunks, ps, layout, side: Path, out: Path) -> Path | None:
    """The weights as a checkpoint written and exported (rank 0's HF folder; None elsewhere)."""
    from dataclasses import replace

    from hfmeg.checkpoint.mp_layout import iteration_dir_name
    from hfmeg.checkpoint.mp_save import staged_save

    layout = replace(layout, iteration=1)
    with staged_save(layout, ps, out / "mp", side) as folder:
        part.write_model(chunks, ps, layout, folder)
    if ps.rank != 0:
        return None
    return part.export(out / "mp" / iteration_dir_name(1), out)[0]


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(a) == sorted(b), what
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k)
        assert torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)), (what, k)


def _push(root: str, tp: int, pp: int, lora: bool):
    from hfmeg.checkpoint.mp_save import chunks_layout
    from hfmeg.generation.transformers_engine import TransformersEngine
    from hfmeg.peft.config import PeftConfig
    from hfmeg.train.config import ModelArgs, ParallelArgs, TrainConfig
    from hfmeg.train.parts import part_class

    root, folder = Path(root), stories_or_skip()
    cfg = TrainConfig(model=ModelArgs(path=str(folder), dtype="fp32"), parallel=ParallelArgs(tp=tp, pp=pp),
                      peft=PeftConfig(**LORA) if lora else PeftConfig())
    ps = make_ps(tp=tp, pp=pp)
    part = part_class(cfg)(cfg, ps, torch.float32)
    chunks, side = part.build(None, 0)
    part.check_base({})
    layout = chunks_layout(chunks, ps, None)

    _perturb(chunks, 0)
    live = part.export_live(chunks, layout, side, root / "live" / "hf")
    files = _file_path(part, chunks, ps, layout, side, root / "files0")
    engine = None
    if ps.rank == 0:
        assert not (root / "live" / "mp").exists() and sorted(p.name for p in (root / "live").iterdir()) == ["hf"]
        _bits_equal(_tensors(live), _tensors(files), "export_live vs the file path's export")
        engine = TransformersEngine(live, [2], 0)
        before = {k: v.clone() for k, v in engine.model.state_dict().items()}

    _perturb(chunks, 1)
    weights = part.live_weights(chunks, layout, side)
    files = _file_path(part, chunks, ps, layout, side, root / "files1")
    if ps.rank != 0:
        assert weights is None
        return None
    pushed = dict(weights)
    engine.load_tensors(pushed.items())
    want = TransformersEngine(files, [2], 0).model.state_dict()
    got = engine.model.state_dict()
    _bits_equal(got, want, "the engine after a push vs built from the file path's export")
    changed = sorted(k for k in got if not torch.equal(got[k], before[k]))
    return changed, sorted(pushed)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_push_without_files_equals_the_file_path(tmp_path, lora):
    stories_or_skip()
    for tp, pp in ((1, 1), (2, 2)):
        results = [r for r in spawn(_push, tp * pp, str(tmp_path / f"tp{tp}pp{pp}"), tp, pp, lora) if r is not None]
        assert len(results) == 1
        changed, pushed = results[0]
        if lora:  # only the adapted projections are pushed, and they are what changed
            assert pushed and all(k.endswith(("q_proj.weight", "v_proj.weight", "down_proj.weight")) for k in pushed)
            assert changed == pushed
        else:  # every tensor of the export (the tied head is the embedding's), all of them moved
            assert "model.embed_tokens.weight" in pushed and changed == sorted(set(changed) | set(pushed)) != []
