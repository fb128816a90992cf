"""sha256 of everything the tensor-layout code produces, to prove a layout refactor changes no output bit.

For every family test checkpoint the suite builds (`tests/tiny_models.py`'s kinds and `tests/releases/*.json`) it
converts HF -> shards at TP2 x PP2 and TP1 and back to HF, and records the sha256 of every tensor written on either
way; it imports peft-made LoRA/DoRA adapters onto TP2 x PP2 shards for a few families (fused QKV, fused
`qkv_proj`/`gate_up_proj`, Gated DeltaNet, stacked experts, a shared expert, MLA), hashing each rank's adapter
tensors and the re-exported PEFT file; and it records `adapters.check_model`'s verdict for each family, target set
and TP size. A conversion that is refused is recorded by its message (a verdict too).

    python tools/layout_hashes.py OUT.json            # write the record
    python tools/layout_hashes.py OUT.json --against BASE.json   # and say which entries differ (exit 1 if any)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from peft_helpers import make_base_and_adapter  # noqa: E402
from release_models import RELEASES, published, save_release  # noqa: E402
from tiny_models import MOE_KINDS, RANDOM_KINDS, save_tiny  # noqa: E402

from hfmeg.checkpoint.convert import hf_to_mp, load_model_config, mp_to_hf  # noqa: E402
from hfmeg.peft.adapter_files import WEIGHTS_FILE, read_peft_folder  # noqa: E402
from hfmeg.peft.adapters import check_model  # noqa: E402
from hfmeg.peft.config import PeftConfig  # noqa: E402
from hfmeg.peft.export import export_checkpoint  # noqa: E402
from hfmeg.peft.layout_shards import import_adapter  # noqa: E402

KINDS = RANDOM_KINDS + MOE_KINDS + ("qwen3_5", "qwen3_5_moe", "gpt_oss", "deepseek_v3")
LAYOUTS = {"tp2pp2": dict(tp=2, pp=2), "tp1": dict(tp=1, pp=1), "tp4": dict(tp=4, pp=1)}
# "save": LoRA plus the vocabulary-split `modules_to_save` (embed_tokens, lm_head)
ADAPTERS = {"llama3": ("lora", "dora", "save"), "phi3": ("lora", "dora"), "qwen3_5": ("lora", "dora"),
            "mixtral": ("lora",), "qwen3_moe": ("lora",), "qwen2_moe": ("lora",), "llama_tied": ("lora",),
            "deepseek_v3": ("lora",)}
TARGETS = (["all-linear"], ["q_proj", "k_proj", "v_proj", "o_proj"], ["gate_proj", "up_proj", "down_proj"])


def _digest(t: torch.Tensor) -> str:
    return f"{t.dtype}{list(t.shape)}:" + hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def tensor_hashes(folder: Path) -> dict[str, str]:
    """`relative file/tensor name` -> dtype, shape and sha256 of every tensor in the folder's safetensors files."""
    out = {}
    for path in sorted(folder.rglob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                out[f"{path.relative_to(folder)}/{name}"] = _digest(f.get_tensor(name))
    return out


def _attempt(fn):
    try:
        return fn()
    except Exception as e:  # a refusal is an outcome to compare, not a failure of the record
        return {"refused": _untemp(f"{type(e).__name__}: {e}")}


def _untemp(text):
    """`text` without the run's temporary folder (refusals name files in it)."""
    return re.sub(r"/tmp/tmp\w+/", "<tmp>/", text) if isinstance(text, str) else text


def sources(root: Path) -> dict[str, Path]:
    out = {}
    for kind in KINDS:
        out[kind] = save_tiny(kind, root / kind)
    for path in sorted(RELEASES.glob("*.json")):
        name = path.stem
        layout = "5.x" if "text_config" in published(name) else None
        out[f"release:{name}"] = save_release(name, root / name, layout=layout)
    return out


def conversions(root: Path, folders: dict[str, Path]) -> dict:
    record = {}
    for name, hf in folders.items():
        for tag, layout in LAYOUTS.items():
            mp, back = root / f"{name}.{tag}.mp", root / f"{name}.{tag}.hf"

            def run():
                hf_to_mp(hf, mp, **layout)
                mp_to_hf(mp, back)
                return {"shards": tensor_hashes(mp), "hf": tensor_hashes(back)}

            record[f"{name}/{tag}"] = _attempt(run)
            print(name, tag, "refused" if "refused" in record[f"{name}/{tag}"] else "ok", flush=True)
    return record


def adapters(root: Path) -> dict:
    record = {}
    for kind, methods in ADAPTERS.items():
        for method in methods:
            saved = ["embed_tokens", "lm_head"] if method == "save" else None
            base, adapter = make_base_and_adapter(root / "peft", kind, dora=method == "dora", modules_to_save=saved)
            mp = root / f"peft.{kind}.{method}.mp"

            def run():
                cfg, tensors = read_peft_folder(adapter)
                hf_to_mp(base, mp, tp=2, pp=2, extra=partial(import_adapter, cfg=cfg, tensors=tensors, base=str(base)))
                iter_dir = mp / "release"
                exported = export_checkpoint(iter_dir, root / f"peft.{kind}.{method}.out")
                shards = {k: v for k, v in tensor_hashes(iter_dir).items() if "adapter" in k}
                with safe_open(str(exported / WEIGHTS_FILE), "pt") as f:
                    out = {k: _digest(f.get_tensor(k)) for k in f.keys()}
                return {"shards": shards, "export": out}

            record[f"{kind}/{method}"] = _attempt(run)
            print("adapter", kind, method, "refused" if "refused" in record[f"{kind}/{method}"] else "ok", flush=True)
    return record


def verdicts(folders: dict[str, Path]) -> dict:
    record = {}
    for name, hf in folders.items():
        cfg = _attempt(lambda: load_model_config(hf))
        for tp in (1, 2, 4):
            for targets in TARGETS:
                for method in ("lora", "dora"):
                    key = f"{name}/tp{tp}/{method}/{'+'.join(targets)}"
                    if isinstance(cfg, dict):
                        record[key] = cfg
                        continue
                    peft = PeftConfig(method=method, target_modules=targets)
                    record[key] = _attempt(lambda: check_model(cfg, peft, tp)) or "ok"
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--against", default=None, help="a record to compare with")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = sources(root)
        record = {"verdicts": verdicts(folders), "conversions": conversions(root, folders), "adapters": adapters(root)}
    Path(args.out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    if args.against is None:
        return 0
    base = json.loads(Path(args.against).read_text())
    differ = [f"{part}/{key}" for part in base for key in sorted(set(base[part]) | set(record[part]))
              if json.loads(_untemp(json.dumps(base[part].get(key)))) != record[part].get(key)]
    tensors = sum(len(v.get(k, {})) for part in ("conversions", "adapters") for v in record[part].values()
                  for k in ("shards", "hf", "export"))
    print(json.dumps({"entries": sum(len(v) for v in record.values()), "tensors": tensors, "differ": differ}))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
