"""The planner's LoRA memory (`hfmeg plan --peft lora`) against what a LoRA run allocates on gloo ranks.

Real chunks of a tiny LLaMA get their adapters and the distributed optimizer, as the
trainer builds them; the planner counts the same rank on meta tensors. Buffers, main
grads, optimizer state and the frozen base must agree to the byte (both come from the
same layers and bucket planner, so any difference is a counting error). Activations are
not compared: the planner keeps full fine-tuning's count for them (docs/peft.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from helpers import make_ps, stories_or_skip
from tiny_models import ASSETS, save_tiny
from transformers import LlamaConfig

from hfmeg.checkpoint.hf_reader import HFCheckpoint

from hfmeg.data.microbatch import MicroBatch
from hfmeg.families import model_config_from_hf
from hfmeg.checkpoint.load import load_chunks
from hfmeg.errors import LayoutError
from hfmeg.optim.config import OptimizerConfig
from hfmeg.optim.distributed_optimizer import DistributedOptimizer
from hfmeg.models.decoder import ModelChunk
from hfmeg.parallel.activation_meter import SavedTensorMeter
from hfmeg.parallel.launch import spawn
from hfmeg.parallel.layout import rank_chunks, split_layers
from hfmeg.parallel.pipeline import forward_backward
from hfmeg.parallel.state import ParallelConfig, ParallelState
from hfmeg.peft.adapters import attach, initialise
from hfmeg.peft.config import PeftConfig
from hfmeg.plan.cli import main
from hfmeg.plan.hardware import ClusterSpec, gpu_spec
from hfmeg.plan.layout import PlanLayout
from hfmeg.plan.memory import stage_memory
from hfmeg.plan.models import resolve_model
from hfmeg.plan.profile import default_profile
from hfmeg.plan.search import Job, best_layout
from hfmeg.train import cli

ALPACA = ASSETS / "data" / "alpaca_en_demo.json"
SFT = cli.recipe_config("sft_llama13b")

PEFTS = [PeftConfig(method="lora", r=4, target_modules=["all-linear"]),
         PeftConfig(method="dora", r=8, target_modules=["q_proj", "v_proj", "down_proj"])]
LAYOUTS = [(2, 1), (1, 2)]  # tp, pp on 2 ranks
OPT = OptimizerConfig(mode="overlapped", bucket_size=3000)  # small buckets: padding per bucket is exercised


def _allocated(folder):
    out = []
    for tp, pp in LAYOUTS:
        for peft in PEFTS:
            ps = make_ps(tp=tp, pp=pp)
            chunks = load_chunks(HFCheckpoint(folder), ps)
            for chunk in chunks:
                attach(chunk, peft)
                initialise(chunk, peft, seed=0)
            opt = DistributedOptimizer(chunks, ps, OPT)
            out.append(dict(
                tp=tp, pp=pp, method=peft.method, pp_rank=ps.pp_rank,
                param_buffer=sum(g.param_buffer.numel() * g.param_buffer.element_size() for g in opt.groups),
                grad_buffer=sum(g.grad_buffer.numel() * g.grad_buffer.element_size() for g in opt.groups),
                optimizer_state=opt.state_bytes(),
                frozen=sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()
                           if not p.requires_grad)))
    return out


def test_planner_counts_lora_memory_exactly(tmp_path):
    folder = save_tiny("llama3", tmp_path / "m", num_hidden_layers=3)
    cfg = load_chunks(HFCheckpoint(folder), make_ps())[0].cfg
    rows = [row for rank in spawn(_allocated, 2, str(folder)) for row in rank]
    assert len(rows) == 2 * len(LAYOUTS) * len(PEFTS)
    for row in rows:
        peft = next(p for p in PEFTS if p.method == row["method"])
        m = stage_memory(cfg, PlanLayout(row["tp"], row["pp"], 1, 1), row["pp_rank"], 2, 16, 4, OPT, peft)
        assert (m.param_buffer, m.grad_buffer, m.optimizer_state, m.frozen_weights) == (
            row["param_buffer"], row["grad_buffer"], row["optimizer_state"], row["frozen"]), row
        full = stage_memory(cfg, PlanLayout(row["tp"], row["pp"], 1, 1), row["pp_rank"], 2, 16, 4, OPT)
        assert m.frozen_weights == full.params * 4 and m.grad_buffer < full.grad_buffer / 5


def test_plan_with_peft(capsys):
    args = ["--model", "llama2-13b", "--gpu", "h100", "--gpus", "8", "--global-batch-size", "8",
            "--seq-len", "4096", "--tp", "4", "--recompute", "selective", "--json"]
    assert main(args) == 0
    full = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
    assert main([*args, "--peft", "lora", "--peft-r", "16", "--peft-targets", "all-linear"]) == 0
    lora = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
    assert lora["frozen_weights"] == 2 * full["params"]  # the whole base in bf16, no fp32 copy
    assert lora["optimizer_state"] < full["optimizer_state"] / 50  # 62.6e6 adapter vs 13.0e9 parameters
    assert main([*args, "--peft", "qlora", "--peft-r", "16", "--peft-targets", "all-linear"]) == 0
    qlora = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
    # 13B's linears at 0.5625 bytes a value in place of 2 (embedding, head and norms stay bf16)
    assert 0.25 * lora["frozen_weights"] < qlora["frozen_weights"] < 0.35 * lora["frozen_weights"]
    assert main([*args, "--peft", "lora", "--peft-r", "0"]) == 2
    assert capsys.readouterr().err.strip() == "hfmeg plan: peft.r: must be an integer >= 1, got 0"


def test_lora_fits_where_full_fine_tuning_does_not():
    """LLaMA-2-13B on one 80 GB GPU: full fine-tuning fits no layout; LoRA does (the frozen base in bf16)."""
    spec = gpu_spec("h100")
    cluster = ClusterSpec(spec, 1, 8)
    job = Job(resolve_model("llama2-13b"), cluster, default_profile("h100", spec.peak_flops, spec.hbm_bytes_per_s),
              8, 2048, 2)
    with pytest.raises(LayoutError):
        best_layout(job)
    lora = best_layout(replace(job, peft=PeftConfig(method="lora", r=16, target_modules=["all-linear"])))
    assert lora.memory.total <= cluster.usable_memory and lora.memory.frozen_weights > 24 * 2**30


def _auto_lora(argv):
    return cli.main("test", SFT, argv)


def test_layout_auto_with_lora_trains(tmp_path, capfd):
    model = stories_or_skip()
    out = tmp_path / "run"
    argv = ["--model", str(model), "--data", str(ALPACA), "--layout", "auto", "--peft", "lora", "--seq-len", "64",
            "--global-batch-size", "4", "--max-steps", "3", "--lr", "1e-2", "--warmup-steps", "1",
            "--out", str(out), "--report-to", "none"]
    assert spawn(_auto_lora, 2, argv) == [0, 0]
    assert re.search(r"^layout auto: \S+ \(the fastest that fits; 2 x cpu, ", capfd.readouterr().out, re.M)
    assert (out / "adapter" / "adapter_config.json").is_file()


SEVEN_B = dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
               vocab_size=32000, max_position_embeddings=4096)  # LLaMA-2-7B's layer and vocabulary shapes


def _measured_lora(cfg, lay: PlanLayout, global_batch: int, seq: int, peft: PeftConfig) -> dict:
    """One LoRA step of the runtime at `lay`, fp32 on CPU: the saved-tensor meter's activation peak (as the
    planner's own measurements take it, plan/measure.py), the optimizer's buffers and state, the frozen base."""
    ps = ParallelState(ParallelConfig(tp=lay.tp, pp=lay.pp, sequence_parallel=lay.sp), dist.get_rank(),
                       dist.get_world_size(), torch.device("cpu"))
    torch.manual_seed(0)
    chunks = [ModelChunk(cfg, ps, s.layers, pre_process=s.pre_process, post_process=s.post_process)
              for s in rank_chunks(split_layers(cfg.num_layers, lay.pp, lay.vpp), ps.pp_rank)]
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.normal_(0.0, 0.02)
            attach(chunk, peft)
            initialise(chunk, peft, seed=0)
    opt = DistributedOptimizer(chunks, ps, OPT)
    g = torch.Generator().manual_seed(0)
    mbs = [MicroBatch(input_ids=(ids := torch.randint(0, cfg.vocab_size, (lay.micro_batch, seq), generator=g)),
                      labels=ids) for _ in range(lay.microbatches(global_batch))]
    meter = SavedTensorMeter(chunks)
    with meter.hooks():
        forward_backward(chunks, ps, mbs, schedule="1f1b", num_tokens=global_batch * seq, grad_sync=opt)
    opt.step()
    return dict(pp_rank=ps.pp_rank, activations=meter.peak, optimizer_state=opt.state_bytes(),
                buffers=sum(g.param_buffer.numel() * g.param_buffer.element_size()
                            + g.grad_buffer.numel() * g.grad_buffer.element_size() for g in opt.groups),
                frozen=sum(p.numel() * p.element_size() for c in chunks for p in c.parameters()
                           if not p.requires_grad))


def test_planner_predicts_lora_memory_at_7b_shapes_within_5_percent():
    """LLaMA-2-7B's layer shapes (2 of its 32 layers, its 32000 vocabulary) with LoRA r 16 on every projection,
    TP2 + SP on 2 gloo ranks, seq 512: the planner's per-rank memory against what one runtime step holds."""
    cfg = model_config_from_hf(LlamaConfig(**SEVEN_B, num_hidden_layers=2))
    lay, peft, seq = PlanLayout(2, 1, 1, 1), PeftConfig(method="lora", r=16, target_modules=["all-linear"]), 512
    for row in spawn(_measured_lora, 2, cfg, lay, 2, seq, peft, timeout_s=600):
        m = stage_memory(cfg, lay, row["pp_rank"], 2, seq, 4, OPT, peft)
        measured = row["activations"] + row["buffers"] + row["optimizer_state"] + row["frozen"]
        assert (m.param_buffer + m.grad_buffer, m.optimizer_state, m.frozen_weights) == (
            row["buffers"], row["optimizer_state"], row["frozen"])  # counted from the same layers: exact
        print(f"7B-shape LoRA rank memory: planned {m.measurable / 2**20:.1f} MiB, measured "
              f"{measured / 2**20:.1f} MiB; activations planned {m.activations / 2**20:.1f} MiB, measured "
              f"{row['activations'] / 2**20:.1f} MiB")
        assert abs(m.measurable - measured) <= 0.05 * measured, (m, row)
