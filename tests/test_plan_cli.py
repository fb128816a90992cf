"""`hfmeg plan`: the ranked table, one layout as JSON, bad inputs as one line and exit 2, calibration."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import yaml
from transformers import LlamaConfig, MixtralConfig

from hfmeg.errors import HfmegError
from hfmeg.commands.main import main as hfmeg  # the console script: `hfmeg plan ...`
from hfmeg.plan.cli import main
from hfmeg.plan.hardware import ClusterSpec, gpu_spec
from hfmeg.plan.layout import PlanLayout, parse_layout
from hfmeg.plan.memory import memory
from hfmeg.plan.models import resolve_model
from hfmeg.plan.profile import default_profile, load_profile
from hfmeg.plan.search import Job, best_layout, candidates, evaluate, search
from hfmeg.train.cli import RECIPE_DIR
from recipe_models import RECIPE_MODELS

JOB = ["--gpu", "h100", "--gpus", "16", "--global-batch-size", "64", "--seq-len", "2048"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A 1.3B-ish LLaMA as an HF folder (config.json only: planning needs no weights)."""
    folder = tmp_path_factory.mktemp("llama")
    LlamaConfig(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16,
                num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A small Mixtral (8 experts, top 2) as a bare config.json."""
    folder = tmp_path_factory.mktemp("mixtral")
    MixtralConfig(hidden_size=1024, intermediate_size=3584, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                  max_position_embeddings=4096).save_pretrained(folder)
    return folder / "config.json"


def _fail(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hfmeg plan: "), err
    return err[0]


def test_one_layout_as_json(small, capsys):
    argv = ["--model", str(small), *JOB, "--tp", "2", "--pp", "2", "--micro-batch-size", "2",
            "--recompute", "selective", "--optimizer", "distributed", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("memory_bytes_per_gpu", "step_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu"):
        assert out[key] > 0, key
    assert out["layout"] == "tp2sp-pp2-dp4-mb2-selective-distributed"
    lay = parse_layout(out["layout"])
    assert out["memory_bytes_per_gpu"] == memory(resolve_model(str(small)), lay, 64, 2048).total
    assert out["tokens_per_s_per_gpu"] == pytest.approx(64 * 2048 / out["step_s"] / 16)
    assert 0 < out["mfu"] < 1


def test_ranked_table_from_a_bare_config_json(small, capsys):
    assert main(["--model", str(small / "config.json"), *JOB, "--top", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if re.match(r"^\s*\d+ tp", line)]
    assert len(rows) == 3
    steps = [float(r.split()[3]) for r in rows]
    assert steps == sorted(steps)
    assert "rejected" in out and "plain data parallelism" in out
    rules = [line.split(" (e.g. ")[0] for line in out.splitlines() if re.match(r"^\s+\d+ x ", line)]
    assert rules and not any(re.search(r"\bN\b", rule) for rule in rules), rules  # rules, not placeholders


@pytest.mark.parametrize("argv, words", [
    (["--gpu", "b300"], "--gpu 'b300' is not known"),
    (["--gpu", "custom", "--peak-tflops", "100"], "--gpu custom needs"),
    (["--tp", "3"], "world size 16 is not a multiple of TP x CP x PP = 3 x 1 x 1"),
    (["--tp", "2", "--pp", "32", "--gpus", "64"], "more than the model's 16 layers"),
    (["--tp", "2", "--pp", "2", "--recompute", "sometimes"], "--recompute"),
    (["--tp", "2", "--ep", "2"], "no experts to spread"),
])
def test_bad_inputs_exit_2_with_one_line(small, capsys, argv, words):
    assert words in _fail(capsys, ["--model", str(small), *JOB, *argv])


def _evaluate(capsys, argv) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_expert_parallel_layout_as_json(moe, capsys):
    """EP 2 halves the experts a rank holds and adds all-to-alls; EP 1 of the same layout has none."""
    one = ["--model", str(moe), *JOB, "--tp", "2", "--micro-batch-size", "2", "--json"]
    ep1, ep2 = _evaluate(capsys, one), _evaluate(capsys, [*one, "--ep", "2"])
    assert ep2["layout"] == "tp2sp-pp1-dp8-ep2-mb2-none-overlapped"
    assert ep1["layout"] == ep2["layout"].replace("-ep2", "")
    assert parse_layout(ep2["layout"]).ep == 2
    assert ep2["time"]["ep_comm_s"] > 0 == ep1["time"]["ep_comm_s"]
    assert ep2["memory"]["expert_padded"] > 0 == ep1["memory"]["expert_padded"]
    assert ep2["memory"]["param_buffer"] < ep1["memory"]["param_buffer"]
    assert ep2["memory_bytes_per_gpu"] < ep1["memory_bytes_per_gpu"]
    assert ep2["tflops_per_gpu"] > 0 and 0 < ep2["mfu"] < 1


def test_the_search_tries_expert_parallelism_for_moe_models_only(moe, small):
    spec = gpu_spec("h100")
    prof = default_profile("h100", spec.peak_flops, spec.hbm_bytes_per_s)
    moe_job = Job(resolve_model(str(moe)), ClusterSpec(spec, 16, 8), prof, 64, 2048)
    eps = {lay.ep for lay in candidates(moe_job)}
    assert eps == {1, 2, 4, 8}  # divisors of DP (16 at most) that divide 8 experts
    assert all(lay.dp % lay.ep == 0 for lay in candidates(moe_job))
    assert {lay.ep for lay in candidates(replace(moe_job, cfg=resolve_model(str(small))))} == {1}


def test_expert_all_to_all_time_is_the_routed_bytes_over_the_ep_link(moe):
    """Per MoE layer and micro-batch: dispatch + combine forward and backward, each (EP-1)/EP of the n·k·h routed
    bytes plus a latency per peer, and the count exchange's latency; NVLink inside a node, the NICs across nodes."""
    cfg = resolve_model(str(moe))
    spec = gpu_spec("h100")
    prof = default_profile("h100", spec.peak_flops, spec.hbm_bytes_per_s)
    m, mb, seq, ep = 4, 1, 2048, 8
    for per_node in (8, 4):  # EP 8 inside a node, then over two
        cluster = ClusterSpec(spec, 16, per_node, inter_node_bytes_per_s=400e9 / 8)
        lay = PlanLayout(1, 1, 16, mb, optimizer="distributed", ep=ep)
        t = evaluate(Job(cfg, cluster, prof, 16 * mb * m, seq), lay).time
        bw, lat = cluster.link(ep, 1, all_to_all=True, crosses=per_node < ep)
        assert (bw == spec.intra_node_bytes_per_s) == (per_node == 8)
        one = (ep - 1) / ep * 2 * mb * seq * 2 * cfg.hidden_size / (bw * prof.link_efficiency) + (ep - 1) * lat
        per_layer = 2 * (2 * one + (ep - 1) * lat)
        assert t.ep_comm_s == pytest.approx(m * cfg.num_layers * per_layer)


def test_the_expert_all_to_all_crosses_nodes_where_the_rank_grid_says(moe):
    """EP ranks are DP neighbours, TP x CP ranks apart (parallel/grid.py): at TP2 x CP2 the two ranks of an EP 2
    group are 4 apart, so on 4-GPU nodes the all-to-all rides the NICs and on 8-GPU nodes NVLink."""
    cfg = resolve_model(str(moe))
    spec = gpu_spec("h100")
    prof = default_profile("h100", spec.peak_flops, spec.hbm_bytes_per_s)
    lay = PlanLayout(2, 1, 2, 1, optimizer="distributed", ep=2, cp=2)
    ep_s = {}
    for per_node in (4, 8):
        assert ("ep" in replace(lay.grid, per_host=per_node).crossing()) == (per_node == 4)
        cluster = ClusterSpec(spec, 8, per_node, inter_node_bytes_per_s=400e9 / 8)
        ep_s[per_node] = evaluate(Job(cfg, cluster, prof, 4, 2048), lay).time.ep_comm_s
    assert ep_s[4] > ep_s[8] > 0


def test_layout_auto_searches_only_layouts_that_keep_tp_and_ep_inside_a_node(moe):
    """`--layout auto` (Job.cross_host False) gets no layout ParallelState would refuse; `hfmeg plan` times them."""
    spec = gpu_spec("h100")
    prof = default_profile("h100", spec.peak_flops, spec.hbm_bytes_per_s)
    kept = Job(resolve_model(str(moe)), ClusterSpec(spec, 8, 2), prof, 16, 2048, cross_host=False)
    with pytest.raises(HfmegError, match=r"^EP=4: its group of ranks \[0, 1, 2, 3\] spans hosts \[0, 1\] \(2 ranks"):
        evaluate(kept, PlanLayout(1, 1, 8, 1, ep=4))
    assert evaluate(replace(kept, cross_host=True), PlanLayout(1, 1, 8, 1, ep=4)).time.ep_comm_s > 0
    fits, reasons, _ = search(kept)
    assert fits and {"EP=4", "EP=8"} <= set(reasons)
    assert all(not {"tp", "ep"} & set(replace(ev.layout.grid, per_host=2).crossing()) for ev in fits)


@pytest.mark.parametrize("argv, words", [
    (["--tp", "2", "--ep", "16"], "EP=16 does not divide DP=8"),
    (["--gpus", "24", "--global-batch-size", "48", "--tp", "2", "--ep", "3"],
     "8 experts cannot be split evenly over parallel.ep=3"),
    (["--explain", "tp2sp-pp1-dp8-ep3-mb1-none"], "EP=3 does not divide DP=8"),
    (["--ep", "2"], "--ep evaluate one layout, with --tp"),  # not silently searched over
])
def test_bad_expert_parallel_inputs_exit_2_with_one_line(moe, capsys, argv, words):
    assert words in _fail(capsys, ["--model", str(moe), *JOB, *argv])


def test_model_that_fits_nowhere_and_unknown_models(capsys, tmp_path, monkeypatch):
    line = _fail(capsys, ["--model", "llama2-70b", "--gpu", "a100-40", "--gpus", "1", "--global-batch-size", "8",
                          "--seq-len", "4096"])
    assert "fits no layout" in line
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read at import: the env var is too late
    line = _fail(capsys, ["--model", "nobody/no-such-model-xyz", *JOB])
    assert "not a local folder nor in the local Hugging Face cache" in line and "HF_HUB_OFFLINE is set" in line
    assert "built-in names: gpt-3.6b" in line
    assert "no such folder or file" in _fail(capsys, ["--model", str(tmp_path / "missing.json"), *JOB])


def test_seed_example_by_default_prefers_model_parallelism_over_plain_dp():
    cfg = resolve_model("gpt-3.6b")
    spec = gpu_spec("a100-40")
    job = Job(cfg, ClusterSpec(spec, 128, 8), default_profile("a100-40", spec.peak_flops, spec.hbm_bytes_per_s),
              512, 1024)
    best = best_layout(job)
    plain = evaluate(job, PlanLayout(1, 1, 128, 1))
    # 100 Gbps per node: plain DP's rings move 6 B x 3.8B params per step through every node's NICs (a ring
    # crosses each node boundary once), more than a step's compute can hide; the best layout keeps DP in a node.
    assert best.time.step_s < 0.6 * plain.time.step_s
    assert best.layout.tp * best.layout.pp > 1


def test_rings_cross_each_node_once_and_all_to_alls_send_each_ranks_bytes_off_node():
    cluster = ClusterSpec(gpu_spec("a100-80"), 32, 8, inter_node_bytes_per_s=100e9)
    assert cluster.link(4, 2, crosses=False) == (300e9, cluster.intra_node_latency_s)  # one node: NVLink
    # A node's NICs (100 GB/s) are shared by the groups that have members in it: G/k groups of k members.
    assert cluster.link(32, 1, crosses=True)[0] == pytest.approx(100e9)  # one group, 8 members per node
    assert cluster.link(4, 8, crosses=True)[0] == pytest.approx(12.5e9)  # 8 groups (TP 8), one member each
    assert cluster.link(8, 2, crosses=True)[0] == pytest.approx(50e9)  # 2 groups of 4 members
    # all-to-all over 32 ranks: 24/32 of each rank's bytes leave the node at 100/8 GB/s each, the rest on NVLink
    bw, _ = cluster.link(32, 1, all_to_all=True, crosses=True)
    assert 31 / 32 / bw == pytest.approx(24 / 32 / 12.5e9)


def test_overlap_hides_dp_communication_that_distributed_mode_exposes():
    cfg = resolve_model("llama2-13b")
    spec = gpu_spec("h100")
    cluster = ClusterSpec(spec, 128, 8, inter_node_bytes_per_s=4 * 200e9 / 8)
    job = Job(cfg, cluster, default_profile("h100", spec.peak_flops, spec.hbm_bytes_per_s), 512, 4096)
    over = evaluate(job, PlanLayout(4, 1, 32, 1, recompute="selective"))
    dist = evaluate(job, PlanLayout(4, 1, 32, 1, recompute="selective", optimizer="distributed"))
    assert over.time.dp_exposed_s < dist.time.dp_exposed_s
    assert over.time.compute_s == dist.time.compute_s


def test_calibrate_writes_a_profile_the_planner_loads(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    assert hfmeg(["plan", "calibrate", "--max-n", "128", "--repeats", "1", "--out", str(out)]) == 0
    prof = load_profile(out)
    assert prof.cores >= 1 and prof.layer_overhead_s > 0 and prof.bucket_overhead_s >= 0
    assert [r for r, _, _ in prof.links][:3] == [2, 4, 8] and all(bw > 0 and lat >= 0 for _, bw, lat in prof.links)
    assert prof.link(3) == prof.links[0][1:] and prof.link(1000) == prof.links[-1][1:]
    assert [r for r, _ in prof.slowdown] == [r for r, _, _ in prof.links] and min(f for _, f in prof.slowdown) >= 1
    assert prof.sequence_parallel_comm >= 0
    assert max(e for _, e in prof.matmul) == pytest.approx(1.0)  # CPU: efficiency relative to the best rate
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["profile"] == str(out)


def test_scaling_mode_reports_both_optimizers(capsys):
    assert hfmeg(["plan", "scaling", "--gpus", "32,64", "--tp", "8"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["gpus"] for r in rows] == [32, 64]
    for r in rows:
        assert r["overlapped"]["dp_exposed_s"] < r["distributed"]["dp_exposed_s"]
    assert rows[0]["overlapped"]["scaling_efficiency"] == 1.0


def test_unfused_attention_pays_for_its_score_traffic():
    """Megatron-LM's 2021 attention materialises b·a·s² scores; at head dim 96 their traffic, not the FLOPs,
    sets its time, and it grows with s² while the rest of the layer grows with s."""
    spec = gpu_spec("a100-80")
    prof = default_profile("a100-80", spec.peak_flops, spec.hbm_bytes_per_s)
    cfg = resolve_model("gpt-3.6b")
    lay = PlanLayout(2, 1, 8, 1, recompute="full", sequence_parallel=False, optimizer="ddp")
    ratios = []
    for seq in (1024, 4096):
        job = Job(cfg, ClusterSpec(spec, 16, 8), prof, 16, seq)
        flash, unfused = (evaluate(replace(job, attention=a), lay).time for a in ("flash", "unfused"))
        assert unfused.compute_s > flash.compute_s and unfused.tp_comm_s == flash.tp_comm_s
        ratios.append(unfused.compute_s / flash.compute_s)
    assert ratios[1] > ratios[0]
    with pytest.raises(HfmegError, match="attention kernels 'sdpa'"):
        evaluate(replace(job, attention="sdpa"), lay)


def test_published_comparison_reports_every_row(capsys, monkeypatch):
    from hfmeg.plan import published

    monkeypatch.setattr(published, "MEGATRON_2021", published.MEGATRON_2021[:2])
    assert main(["published"]) == 0  # the last row calibrates the matmul curve, the others are predicted
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["published_tflops"] for r in lines[:-1]] == [137, 138]
    assert lines[1]["calibration_row"] and abs(lines[1]["error"]) < 0.002 and "calibration_row" not in lines[0]
    assert lines[-1]["rows"] == 1 and lines[-1]["median_abs_error"] >= 0 and "matmul x" in lines[-1]["profile"]
    assert main(["published", "--uncalibrated"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {
        "rows": 2, "median_abs_error": pytest.approx(lines[-1]["median_abs_error"], abs=1), "profile": "a100 (assumed)"}


@pytest.mark.parametrize("name", sorted(RECIPE_MODELS))
def test_recipe_memory_arithmetic_is_the_planners(name, tmp_path, capsys):
    """Each recipe's memory lines (`= x GiB  [key]` in its YAML comment) are what `hfmeg plan` says for its real
    model (tests/recipe_models.py) in its layout on its GPUs, to the 0.1 GiB they are stated to; the layout fits."""
    config, gpus = RECIPE_MODELS[name]
    model = tmp_path / "config.json"
    model.write_text(json.dumps(config))
    text = (RECIPE_DIR / f"{name}.yaml").read_text()
    recipe = yaml.safe_load(text)
    par, train = recipe["parallel"], recipe["train"]
    argv = ["--model", str(model), "--gpu", "h100", "--gpus", str(gpus), "--global-batch-size",
            str(train["global_batch_size"]), "--seq-len", str(recipe["data"]["seq_len"]), "--tp", str(par["tp"]),
            "--pp", str(par["pp"]), "--ep", str(par.get("ep", 1)), "--micro-batch-size", str(train["micro_batch_size"]),
            "--recompute", recipe["model"]["recompute"], "--json"]
    if par["tp"] > 1 and not par["sequence_parallel"]:
        argv.append("--no-sequence-parallel")
    assert main(argv) == 0, capsys.readouterr().err  # an out-of-memory layout exits 2
    planned = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]
    stated = {key: float(gib) for gib, key in re.findall(r"= *([0-9.]+) GiB +\[(\w+)\]", text)}
    assert set(stated) == {"param_buffer", "grad_buffer", "optimizer_state", "activations", "transient", "total"}
    for key, gib in stated.items():
        assert abs(gib - planned[key] / 2**30) <= 0.05 + 1e-9, (key, gib, planned[key] / 2**30)
    assert planned["total"] < gpu_spec("h100").memory_bytes, planned
