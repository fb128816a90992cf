"""`--layout auto`: the hardware read off the device, the choice applied to the config, the report line,
and a recipe run on 4 gloo ranks that trains with the planner's layout and keeps it when it resumes.

The bad settings (auto with a layout flag, a layer split, a shard folder) are in test_config_validation.py.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, replace

import pytest
import torch
import yaml
from transformers import LlamaConfig

from helpers import stories_or_skip
from hfmeg.families import model_config_from_hf
from hfmeg.errors import CheckpointError, UnsupportedConfigError
from hfmeg.parallel.launch import spawn
from hfmeg.plan.auto import choice_line, detect_cluster, report
from hfmeg.plan.hardware import gpu_kind
from hfmeg.plan.hardware import GIB, ClusterSpec, GpuSpec
from hfmeg.plan.layout import parse_layout
from hfmeg.plan.profile import ASSUMED, load_profile
from hfmeg.plan.search import Job, best_layout, evaluate
from hfmeg.train import cli
from hfmeg.train.auto_layout import LayoutReport, apply_layout, layout_of, resolve_layout
from hfmeg.train.config import ModelArgs, ParallelArgs, TrainConfig
from hfmeg.train.dataclass_io import build
from hfmeg.train.metrics import read_metrics
from tiny_models import ASSETS

ALPACA = ASSETS / "data" / "alpaca_en_demo.json"
SFT = cli.recipe_config("sft_llama13b")


def _cfg(layers=4, hidden=64):
    return model_config_from_hf(LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                            num_attention_heads=8, num_key_value_heads=4, vocab_size=300,
                                            max_position_embeddings=256))


def test_gpu_names_map_to_the_shipped_kinds():
    assert gpu_kind("NVIDIA H100 80GB HBM3", 80 * GIB) == "h100"
    assert gpu_kind("NVIDIA H200", 141 * GIB) == "h200"
    assert gpu_kind("NVIDIA A100-SXM4-40GB", 40 * GIB) == "a100-40"
    assert gpu_kind("NVIDIA A100 80GB PCIe", 80 * GIB) == "a100-80"
    assert gpu_kind("NVIDIA L40S", 48 * GIB) == "l40s"
    assert gpu_kind("NVIDIA A10", 24 * GIB) == "a10"
    assert gpu_kind("NVIDIA A10G", 24 * GIB) is None  # another chip (AWS), not the A10's peak
    assert gpu_kind("NVIDIA GeForce RTX 4090", 24 * GIB) is None


def test_cpu_cluster_a_choice_that_uses_every_rank_and_its_lines():
    cluster, profile = detect_cluster(4, 4, torch.device("cpu"))
    assert cluster.gpus == 4 and cluster.usable_memory > 0 and profile.peak_flops > 0 and profile.cores >= 1
    ev = best_layout(Job(_cfg(), cluster, profile, global_batch=8, seq_len=64, dtype_bytes=4), "distributed")
    lay = ev.layout
    assert lay.tp * lay.pp * lay.dp == 4 and 8 % (lay.dp * lay.micro_batch) == 0 and lay.optimizer == "distributed"
    assert choice_line(ev, cluster, "why").startswith(f"layout auto: {lay.name()} (why; 4 x cpu, ")
    line = report(ev, measured_step_s=ev.time.step_s * 2, measured_peak_bytes=None)
    assert line.startswith(f"layout {lay.name()}: step ") and "(-50%)" in line and "not measured off CUDA" in line
    line = report(ev, measured_step_s=ev.time.step_s, measured_peak_bytes=ev.memory.total // 2)
    assert "(+0%)" in line and "(+100%)" in line


def test_a_calibrated_profile_times_the_choice_and_must_match_the_device(tmp_path):
    """`parallel.plan_profile`: the run plans with that profile and its gloo link for the ranks on the host,
    not the quick one measured at start; a GPU profile on CPU ranks is refused naming the field."""
    profile = replace(ASSUMED["h100"], name="cpu x2 (calibrated)", cores=2,
                      links=((2, 7e8, 6e-4), (4, 4e8, 8e-4)), slowdown=((2, 1.1), (4, 2.4)))
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(asdict(profile)))
    cluster, used = detect_cluster(4, 4, torch.device("cpu"), str(path))
    assert used == load_profile(path) and used.name == "cpu x2 (calibrated)"
    assert (cluster.gpu.intra_node_bytes_per_s, cluster.intra_node_latency_s) == (4e8, 8e-4)
    assert cluster.gpus == 4 and math.isfinite(cluster.usable_memory) and cluster.usable_memory > 0
    gpu = tmp_path / "h100.json"
    gpu.write_text(json.dumps(asdict(ASSUMED["h100"])))
    with pytest.raises(UnsupportedConfigError, match=r"parallel.plan_profile: .*h100.json was calibrated on a GPU, "
                                                     r"and this run is on cpu"):
        detect_cluster(4, 4, torch.device("cpu"), str(gpu))


def test_the_choice_replaces_the_layout_fields_in_a_new_config():
    parsed = TrainConfig(model=ModelArgs(path="m", recompute="none"), parallel=ParallelArgs(tp=4, layout="auto"))
    lay = parse_layout("tp2sp-pp2v2-dp1-mb2-selective")
    cfg = apply_layout(parsed, lay)
    p = cfg.parallel
    assert (p.tp, p.pp, p.vpp, p.sequence_parallel, p.run_schedule) == (2, 2, 2, True, "interleaved")
    assert (cfg.train.micro_batch_size, cfg.model.recompute, p.layout, cfg.model.path) == (2, "selective", "auto", "m")
    assert layout_of(cfg, 4) == lay
    # the planner pads the vocabulary by the run's model.vocab_multiple, as the trainer does
    assert layout_of(replace(cfg, model=replace(cfg.model, vocab_multiple=64)), 4).vocab_multiple == 64
    assert (parsed.parallel.tp, parsed.model.recompute) == (4, "none")  # the parsed config is not edited
    moe = parse_layout("tp1-pp1-dp4-ep2-mb1-none")  # an MoE model's choice carries its EP
    assert apply_layout(parsed, moe).parallel.ep == 2 and layout_of(apply_layout(parsed, moe), 4).name() == moe.name()


def test_the_report_skips_the_warm_up_step_and_comes_once():
    cluster = ClusterSpec(GpuSpec("cpu", 1e11, 8 * GIB, 1e10, 1e9), 1, 1, reserved_bytes=0)
    ev = evaluate(Job(_cfg(), cluster, ASSUMED["h100"], 4, 64, 4), parse_layout("tp1-pp1-dp1-mb1-none"))
    check = LayoutReport(ev, first_step=10, max_steps=100, device=torch.device("cpu"))
    lines = [check.after_step(step, seconds) for step, seconds in zip(range(11, 20), [9.0, 1, 1, 3, 1, 1, 1, 1, 1])]
    assert lines[:5] == [None] * 5 and lines[6:] == [None] * 3
    assert lines[5].startswith(f"layout tp1-pp1-dp1-mb1-none-overlapped: step 1.000 s measured vs {ev.time.step_s:.3f}")
    assert LayoutReport(ev, first_step=0, max_steps=3, device=torch.device("cpu")).at == 3  # a short run: its last step


def _resolve_error(cfg: TrainConfig) -> str:
    try:
        resolve_layout(cfg, torch.device("cpu"))
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_an_error_on_rank_0_stops_every_rank_with_the_same_line(tmp_path):
    cfg = TrainConfig(model=ModelArgs(path=str(tmp_path / "absent")), parallel=ParallelArgs(layout="auto"))
    assert spawn(_resolve_error, 2, cfg) == [f"{tmp_path / 'absent'}: no such folder"] * 2


def test_recipe_trains_with_the_planned_layout_reports_it_and_keeps_it_on_resume(tmp_path, capfd):
    model = stories_or_skip()
    if not ALPACA.is_file():
        pytest.skip(f"{ALPACA} is absent")
    out = tmp_path / "run"
    argv = ["--model", str(model), "--data", str(ALPACA), "--layout", "auto", "--seq-len", "64", "--lr", "5e-3",
            "--global-batch-size", "8", "--warmup-steps", "2", "--eval-every", "0", "--save-every", "20",
            "--out", str(out), "--report-to", "none"]
    assert spawn(cli.main, 4, "test", SFT, argv + ["--max-steps", "20"]) == [0] * 4
    printed = capfd.readouterr().out
    chosen = re.findall(r"^layout auto: (\S+) \(the fastest that fits; 4 x cpu, ", printed, re.M)
    assert len(chosen) == 1, printed
    cfg = build(TrainConfig, yaml.safe_load((out / "config.yaml").read_text()))
    assert layout_of(cfg, 4).name() == chosen[0]  # the YAML's tp 4 + selective recompute were replaced
    shards = json.loads((out / "checkpoints" / "iter_0000020" / "hfmeg_layout.json").read_text())
    assert (shards["tp"], shards["pp"], shards["vpp"]) == (cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp)
    reports = re.findall(rf"^layout {re.escape(chosen[0])}: step \S+ s measured vs \S+ s predicted \([-+]\d+%\); "
                         r"memory \S+ MiB/GPU predicted \(not measured off CUDA\)$", printed, re.M)
    assert len(reports) == 1, printed
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses
    # Resumed (the recipe's checkpoint.resume is auto): the checkpoint's layout, not a new choice.
    assert spawn(cli.main, 4, "test", SFT, argv + ["--max-steps", "22"]) == [0] * 4
    kept = f"layout auto: {chosen[0]} (kept from {out / 'checkpoints' / 'iter_0000020'}, whose shards are cut for it"
    assert kept in capfd.readouterr().out
    assert len(read_metrics(out / "metrics.jsonl")) == 22

