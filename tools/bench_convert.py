"""Benchmark: HF -> TP x PP -> HF conversion time and peak memory, against `cp -r`.

Builds a synthetic LLaMA-2-7B-shaped bf16 checkpoint (hidden 4096, FFN 11008, 32
heads, vocab 32000; `--layers` shortens it), sharded like the Hub's (<= 5GB files +
index). Then, each in its own child process:

1. `cp -r` of the HF folder (the anchor: the least any conversion must do);
2. `tools/convert_hf_to_mp.py --tp 4 --pp 2`;
3. `tools/convert_mp_to_hf.py`.

Each step starts after a `sync` and its wall time covers the whole command
(interpreter start-up included) plus the `sync` that makes its output durable, so
no step is billed for another's write-back. Peak RSS is each child's own
`ru_maxrss` (from `os.wait4`), nothing subtracted; this parent stays small (it
imports no torch) because a child's `ru_maxrss` starts from its parent's. Finally
every tensor of the round trip is compared with the source (skip with `--no-check`).
Prints a table, then one JSON line: ckpt_bytes, peak_rss_bytes (the larger
converter), rss_ratio = peak_rss_bytes / ckpt_bytes, convert_s (the slower
converter), copy_s, time_ratio = convert_s / copy_s, plus per-converter figures.
Targets: rss_ratio <= 0.15, time_ratio <= 2.

`--gpt-oss-mxfp4`: a synthetic gpt-oss-20b-shaped checkpoint instead (hidden 2880, 64 / 8 heads of 64, 32 experts
of FFN 2880, vocabulary 201088), its experts in MXFP4 as openai publishes them (random codes and scales), the rest
bf16: the converter dequantizes the experts as it reads them (`checkpoint/quantized.py`), so its peak should stay
about one layer's dequantized experts (`layer_bytes` in the JSON line: 32 x 2880 x 3 x 2880 x 2 B = 1.59 GB) above
the dense case, whatever the layer count; the round trip is compared with the dequantized source.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


def llama7b_specs(layers: int) -> dict:
    import torch

    h, f, v, bf16 = 4096, 11008, 32000, torch.bfloat16
    specs = {"model.embed_tokens.weight": (bf16, (v, h))}
    for i in range(layers):
        p = f"model.layers.{i}."
        specs.update({
            p + "input_layernorm.weight": (bf16, (h,)),
            **{f"{p}self_attn.{x}_proj.weight": (bf16, (h, h)) for x in "qkvo"},
            p + "post_attention_layernorm.weight": (bf16, (h,)),
            p + "mlp.gate_proj.weight": (bf16, (f, h)),
            p + "mlp.up_proj.weight": (bf16, (f, h)),
            p + "mlp.down_proj.weight": (bf16, (h, f)),
        })
    specs["model.norm.weight"] = (bf16, (h,))
    specs["lm_head.weight"] = (bf16, (v, h))
    return specs


GPT_OSS = dict(h=2880, heads=64, kv=8, d=64, experts=32, ffn=2880, vocab=201088)


def gpt_oss_mxfp4_specs(layers: int) -> dict:
    """gpt-oss-20b's tensors at `layers` layers as openai stores them: experts as MXFP4 blocks and scales (uint8)."""
    import torch

    g, bf16, u8 = GPT_OSS, torch.bfloat16, torch.uint8
    h, e, f, q, kv = g["h"], g["experts"], g["ffn"], g["heads"] * g["d"], g["kv"] * g["d"]
    specs = {"model.embed_tokens.weight": (bf16, (g["vocab"], h))}
    for i in range(layers):
        p = f"model.layers.{i}."
        a, x = p + "self_attn.", p + "mlp.experts."
        specs.update({
            p + "input_layernorm.weight": (bf16, (h,)), a + "q_proj.weight": (bf16, (q, h)), a + "q_proj.bias": (bf16, (q,)),
            a + "k_proj.weight": (bf16, (kv, h)), a + "k_proj.bias": (bf16, (kv,)), a + "v_proj.weight": (bf16, (kv, h)),
            a + "v_proj.bias": (bf16, (kv,)), a + "o_proj.weight": (bf16, (h, q)), a + "o_proj.bias": (bf16, (h,)),
            a + "sinks": (bf16, (g["heads"],)), p + "post_attention_layernorm.weight": (bf16, (h,)),
            p + "mlp.router.weight": (bf16, (e, h)), p + "mlp.router.bias": (bf16, (e,)),
            x + "gate_up_proj_blocks": (u8, (e, 2 * f, h // 32, 16)), x + "gate_up_proj_scales": (u8, (e, 2 * f, h // 32)),
            x + "gate_up_proj_bias": (bf16, (e, 2 * f)),
            x + "down_proj_blocks": (u8, (e, h, f // 32, 16)), x + "down_proj_scales": (u8, (e, h, f // 32)),
            x + "down_proj_bias": (bf16, (e, h)),
        })
    specs["model.norm.weight"] = (bf16, (h,))
    specs["lm_head.weight"] = (bf16, (g["vocab"], h))
    return specs


def make_checkpoint(folder: Path, layers: int, mxfp4: bool = False) -> None:
    """Write the synthetic checkpoint one tensor at a time (runs in a child process)."""
    import torch
    from transformers import GptOssConfig, LlamaConfig

    from hfmeg.checkpoint.hf_writer import plan_shards
    from hfmeg.checkpoint.st_stream import StreamingSafetensorsWriter

    folder.mkdir(parents=True)
    if mxfp4:
        g = GPT_OSS
        cfg = GptOssConfig(hidden_size=g["h"], intermediate_size=g["ffn"], num_hidden_layers=layers,
                           num_attention_heads=g["heads"], num_key_value_heads=g["kv"], head_dim=g["d"],
                           num_local_experts=g["experts"], num_experts_per_tok=4, vocab_size=g["vocab"],
                           layer_types=(["sliding_attention", "full_attention"] * layers)[:layers])
        cfg.save_pretrained(folder)
        meta = json.loads((folder / "config.json").read_text())
        meta["quantization_config"] = {"quant_method": "mxfp4"}
        (folder / "config.json").write_text(json.dumps(meta))
        specs = gpt_oss_mxfp4_specs(layers)
    else:
        LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096,
                    dtype="bfloat16").save_pretrained(folder)
        specs = llama7b_specs(layers)
    shards = plan_shards(specs, 5 * 10**9)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    gen = torch.Generator().manual_seed(0)
    for file, names in zip(files, shards):
        with StreamingSafetensorsWriter(folder / file, {n: specs[n] for n in names}, {"format": "pt"}) as w:
            for n in names:
                dtype, shape = specs[n]
                if n.endswith("_scales"):  # e8m0 exponents: values of 2^-9 .. 2^-3 times the e2m1 codes
                    w.write(n, torch.randint(118, 124, shape, dtype=dtype, generator=gen))
                elif dtype == torch.uint8:  # two random e2m1 codes a byte
                    w.write(n, torch.randint(0, 256, shape, dtype=dtype, generator=gen))
                else:
                    w.write(n, (torch.randn(shape, generator=gen) * 0.02).to(dtype))
    index = {"metadata": {}, "weight_map": {n: f for f, names in zip(files, shards) for n in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def run_child(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds including a final sync, peak RSS bytes) of one child process."""
    os.sync()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    os.sync()
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def check_round_trip(src: Path, out: Path) -> None:
    """Exit 0 when every tensor of `out` equals the source's, bit for bit (runs in a child process)."""
    import torch

    from hfmeg.checkpoint.hf_reader import HFCheckpoint

    a, b = HFCheckpoint(src), HFCheckpoint(out)
    same = sorted(a.keys()) == sorted(b.keys()) and all(torch.equal(a.get(k), b.get(k)) for k in a.keys())
    raise SystemExit(0 if same else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (32 = LLaMA-2-7B)")
    ap.add_argument("--tp", type=int, default=4)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--workdir", default="out/bench_convert", help="scratch folder (emptied first, removed after)")
    ap.add_argument("--no-check", action="store_true", help="skip the bit-exact comparison of the round trip")
    ap.add_argument("--gpt-oss-mxfp4", action="store_true",
                    help="a gpt-oss-20b-shaped checkpoint with MXFP4 experts (dequantized by the converter)")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # make DIR | check SRC OUT
    args = ap.parse_args()
    if args.child:
        if args.child[0] == "make":
            return make_checkpoint(Path(args.child[1]), args.layers, args.gpt_oss_mxfp4)
        return check_round_trip(Path(args.child[1]), Path(args.child[2]))
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    hf, copy, mp, back = work / "hf", work / "copy", work / "mp", work / "back"
    me = [sys.executable, __file__, "--layers", str(args.layers), *(["--gpt-oss-mxfp4"] * args.gpt_oss_mxfp4),
          "--child"]
    t0 = time.perf_counter()
    subprocess.run(me + ["make", str(hf)], check=True)
    ckpt_bytes = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    shape = "gpt-oss-20b-shaped (MXFP4 experts)" if args.gpt_oss_mxfp4 else "LLaMA-7B-shaped bf16"
    print(f"synthetic {shape} checkpoint: {args.layers} layers, {ckpt_bytes / 1e9:.2f} GB "
          f"(built in {time.perf_counter() - t0:.1f}s)", flush=True)
    copy_s, copy_rss = run_child(["cp", "-r", str(hf), str(copy)])
    shutil.rmtree(copy)
    py = sys.executable
    to_mp_s, to_mp_rss = run_child([py, str(TOOLS / "convert_hf_to_mp.py"), "--hf", str(hf), "--out", str(mp),
                                    "--tp", str(args.tp), "--pp", str(args.pp)])
    to_hf_s, to_hf_rss = run_child([py, str(TOOLS / "convert_mp_to_hf.py"), "--mp", str(mp), "--out", str(back)])
    exact = None if args.no_check else subprocess.run(me + ["check", str(hf), str(back)]).returncode == 0
    shutil.rmtree(work, ignore_errors=True)
    rows = [("cp -r (anchor)", copy_s, copy_rss), (f"HF -> TP{args.tp}xPP{args.pp}", to_mp_s, to_mp_rss),
            (f"TP{args.tp}xPP{args.pp} -> HF", to_hf_s, to_hf_rss)]
    print(f"{'step':<16} {'wall s':>8} {'x cp':>6} {'peak RSS GB':>12} {'RSS/ckpt':>9}")
    for name, wall, rss in rows:
        print(f"{name:<16} {wall:>8.2f} {wall / copy_s:>6.2f} {rss / 1e9:>12.3f} {rss / ckpt_bytes:>9.3f}")
    if exact is not None:
        print(f"round trip bit-exact: {exact}")
    peak, slow = max(to_mp_rss, to_hf_rss), max(to_mp_s, to_hf_s)
    print(json.dumps({
        "layers": args.layers, "tp": args.tp, "pp": args.pp, "ckpt_bytes": ckpt_bytes,
        **({"layer_bytes": GPT_OSS["experts"] * GPT_OSS["h"] * 3 * GPT_OSS["ffn"] * 2} if args.gpt_oss_mxfp4 else {}),
        "peak_rss_bytes": peak, "rss_ratio": round(peak / ckpt_bytes, 4),
        "convert_s": round(slow, 2), "copy_s": round(copy_s, 2), "time_ratio": round(slow / copy_s, 3),
        "hf_to_mp_s": round(to_mp_s, 2), "mp_to_hf_s": round(to_hf_s, 2),
        "hf_to_mp_rss_bytes": to_mp_rss, "mp_to_hf_rss_bytes": to_hf_rss, "bit_exact": exact,
    }))


if __name__ == "__main__":
    main()
