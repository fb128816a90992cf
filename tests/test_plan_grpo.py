"""The planner's count of a GRPO run (`grpo.planner_terms`, `hfmeg plan --generator ...`, plan/rollout.py).

The reference: beta > 0 with full fine-tuning holds the frozen copy the trainer's `FullModel.reference` allocates (the
preference run's count, test_plan_preference.py checks it to the byte) and runs it forward each step; LoRA's is the
base itself; beta 0 holds none. The transformers engine: the model it builds holds the bytes counted, and generating a
batch whose longest prompt has `prompt_len` tokens and whose completions all run to the limit, its KV cache at the end
and its prompt pass's logits are the bytes counted, on a dense model and on an MoE one. The run's rank 0 holds it on
CPU ranks (pipeline stage 0, between steps, when the activations are gone); on GPUs it is in host memory. The vLLM
engine: on a CPU host its fp32 weights and the KV cache it is given (VLLM_CPU_KVCACHE_SPACE GiB); on a GPU the share
vLLM reserves (`vllm_gpu_memory_utilization` of rank 0's GPU). The weights' export folder: what hfmeg's export of
the model in the run's dtype writes, tensor for tensor, in host memory (rank 0's on CPU ranks). `hfmeg plan`'s GRPO
flags reach the same count.
"""

from __future__ import annotations

import pytest
from tiny_models import save_tiny

from hfmeg.config import load_hf_config
from hfmeg.families import model_config_from_hf
from hfmeg.generation.engine import SamplingParams
from hfmeg.generation.transformers_engine import TransformersEngine
from hfmeg.plan.hardware import ClusterSpec, gpu_spec
from hfmeg.plan.layout import PlanLayout
from hfmeg.plan.memory import stage_memory
from hfmeg.plan.profile import default_profile
from hfmeg.plan.rollout import RolloutTerms, engine_bytes, model_parameters
from hfmeg.plan.search import Job, evaluate
from hfmeg.train.grpo import GRPOSettings

GIB = 2**30


@pytest.mark.parametrize("kind", ["llama3", "mixtral"])
def test_engine_holds_what_the_planner_counts(kind, tmp_path):
    folder = save_tiny(kind, tmp_path / kind, output_router_logits=False)
    cfg = model_config_from_hf(load_hf_config(folder))
    vocab = cfg.vocab_size
    engine = TransformersEngine(folder, [vocab + 1], 0)  # an end token it cannot sample: every completion runs
    weights = {p.data_ptr(): p.numel() * p.element_size() for p in engine.model.parameters()}
    prompts = [[1, 5, 9, 3, 7], [1, 7], [2, 4, 6], [8]]
    prompt_len, new = 5, 6
    held = {}
    forward = engine.model.forward

    def keep(*args, **kwargs):
        out = forward(*args, **kwargs)
        held.setdefault("logits", out.logits.numel() * out.logits.element_size())  # the prompt pass's
        held["cache"] = sum(t.numel() * t.element_size() for layer in out.cache.layers for t in (layer.keys,
                                                                                                  layer.values))
        return out

    engine.model.forward = keep
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=new), [0, 1, 2, 3])
    assert all(len(c.completion_ids) == new for c in completions)
    want_weights, want_generating = engine_bytes(cfg, len(prompts), prompt_len, prompt_len + new)
    assert sum(weights.values()) == want_weights
    assert held["logits"] == 4 * len(prompts) * prompt_len * vocab
    assert held["cache"] + held["logits"] == want_generating


def _job(folder, **grpo) -> tuple[Job, PlanLayout]:
    cfg = model_config_from_hf(load_hf_config(folder))
    spec = gpu_spec("h100")
    profile = default_profile("h100", spec.peak_flops, spec.hbm_bytes_per_s)
    terms = GRPOSettings(reward_funcs=["accuracy"], max_completion_length=16, num_generations=4,
                         **grpo).planner_terms(adapters=False, global_batch_size=8, seq_len=32)
    return Job(cfg, ClusterSpec(spec, 2, 2), profile, 8, 32, dtype_bytes=4, **terms), \
        PlanLayout(1, 2, 1, 2, 1, "none", False, "overlapped", "1f1b", 1, 1)


def test_a_grpo_run_counts_its_reference_and_engine(tmp_path):
    from dataclasses import replace

    folder = save_tiny("llama3", tmp_path / "base")
    cfg = model_config_from_hf(load_hf_config(folder))
    job, lay = _job(folder, beta=0.04, steps_per_generation=2)
    assert job.reference_forward and job.reference_copy and job.rollouts == RolloutTerms("transformers", 16, 16, 32)
    plain = [stage_memory(cfg, lay, r, 8, 32, dtype_bytes=4) for r in range(2)]
    with_copy = [stage_memory(cfg, lay, r, 8, 32, dtype_bytes=4, reference_copy=True) for r in range(2)]
    assert all(c.frozen_weights > p.frozen_weights for c, p in zip(with_copy, plain))
    assert not GRPOSettings(reward_funcs=["accuracy"]).planner_terms(False, 8, 32)["reference_copy"]  # beta 0
    lora = GRPOSettings(reward_funcs=["accuracy"], beta=0.04).planner_terms(True, 8, 32)
    assert lora["reference_forward"] and not lora["reference_copy"]  # the base with the adapters off
    assert GRPOSettings(reward_funcs=["accuracy"], generator="vllm", max_completion_length=8).planner_terms(
        False, 8, 32)["rollouts"] == \
        RolloutTerms("vllm", 8, 24, 32, 0.3)

    gpu = evaluate(job, lay).memory  # a GPU cluster: the engine is in host memory
    cpu_job = replace(job, profile=replace(job.profile, cores=2))  # a CPU profile (gloo ranks)
    stages = [stage_memory(cfg, lay, r, 8, 32, dtype_bytes=4, dense_mask=True, reference_copy=True,
                           rollouts=job.rollouts) for r in range(2)]
    weights, generating = engine_bytes(cfg, 16, 16, 32)
    export = 4 * model_parameters(cfg)  # the fp32 run's export folder (test below)
    assert (stages[0].rollouts_held, stages[0].rollouts_generating) == (weights + export, generating)
    assert stages[1].rollouts_held == stages[1].rollouts_generating == 0  # pipeline stage 1: not global rank 0
    assert stages[0].total == stages[0].measurable + weights + export + max(stages[0].transient,
                                                                             generating - stages[0].activations)
    assert evaluate(cpu_job, lay).memory.total == max(s.total for s in stages)
    assert gpu.rollouts_held == 0 and gpu.rollouts_host == weights + generating + export


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_vllm_and_the_export_folder_are_what_rank_0_holds(tmp_path, monkeypatch, dtype):
    """The export folder: hfmeg's export of the model in the run's dtype (`mp_to_hf`, the exporter the weight push
    streams through) holds model_parameters x the dtype's bytes of tensors. vLLM: on CPU ranks its fp32 weights, the
    KV cache VLLM_CPU_KVCACHE_SPACE gives it and the folder are rank 0's (stage 0's); on a GPU, the share of rank 0's GPU
    it reserves, the folder in host memory."""
    from safetensors import safe_open

    from hfmeg.checkpoint.convert import hf_to_mp, mp_to_hf

    folder = save_tiny("llama3", tmp_path / "base")
    cfg = model_config_from_hf(load_hf_config(folder))
    hf_to_mp(folder, tmp_path / "mp", tp=2, pp=1)
    mp_to_hf(tmp_path / "mp", tmp_path / "export", dtype=dtype)
    dtype_bytes = {"bf16": 2, "fp32": 4}[dtype]
    export = 0  # bytes of the exported tensors
    for path in (tmp_path / "export").glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            export += sum(t.numel() * t.element_size() for t in map(f.get_tensor, f.keys()))
    assert export == dtype_bytes * model_parameters(cfg)
    weights = 4 * model_parameters(cfg)  # vLLM's, in the fp32 hfmeg starts it in

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    terms = GRPOSettings(reward_funcs=["accuracy"], generator="vllm", max_completion_length=16,
                         vllm_gpu_memory_utilization=0.25).planner_terms(False, 8, 32)["rollouts"]
    lay = PlanLayout(1, 2, 1, 2, 1, "none", False, "overlapped", "1f1b", 1, 1)
    cpu = [stage_memory(cfg, lay, r, 8, 32, dtype_bytes, dense_mask=True, rollouts=terms) for r in range(2)]
    assert cpu[0].rollouts_held == weights + 3 * GIB + export
    assert cpu[0].rollouts_generating == cpu[1].rollouts_held == 0
    assert cpu[0].total == cpu[0].measurable + cpu[0].rollouts_held + cpu[0].transient
    spec = gpu_spec("h100")
    gpu = stage_memory(cfg, lay, 0, 8, 32, dtype_bytes, rollouts=terms, gpu_bytes=spec.memory_bytes)
    assert gpu.rollouts_held == int(0.25 * spec.memory_bytes) and gpu.rollouts_host == export


def test_hfmeg_plan_counts_a_grpo_run_from_its_flags(tmp_path, capsys):
    """`hfmeg plan --generator vllm --max-completion-length ... [--beta]`: rank 0's GPU holds vLLM's share beside the
    training state, the export folder is host memory, and beta > 0 adds the reference copy a preference run's
    `--loss-type sigmoid` adds; bad GRPO flags are one line, exit 2."""
    import json

    from hfmeg.plan.cli import main

    folder = save_tiny("llama3", tmp_path / "base")
    cfg = model_config_from_hf(load_hf_config(folder))
    job = ["--model", str(folder), "--gpu", "h100", "--gpus", "4", "--global-batch-size", "8", "--seq-len", "64",
           "--tp", "2", "--json"]

    def memory(*flags) -> dict:
        assert main([*job, *flags]) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["memory"]

    plain = memory()
    grpo = ["--generator", "vllm", "--max-completion-length", "16", "--num-generations", "4"]
    vllm = memory(*grpo)
    assert vllm["rollouts_held"] == int(0.3 * gpu_spec("h100").memory_bytes)
    assert vllm["rollouts_host"] == 2 * model_parameters(cfg)  # the bf16 export
    assert vllm["total"] == plain["total"] + vllm["rollouts_held"]
    with_reference = memory(*grpo, "--beta", "0.04")
    assert with_reference["frozen_weights"] - plain["frozen_weights"] == \
        memory("--loss-type", "sigmoid")["frozen_weights"] - plain["frozen_weights"] > 0
    for flags, words in [(["--generator", "vllm"], "--max-completion-length None: a GRPO run"),
                         ([*grpo[:3], "64"], "--max-completion-length 64: a GRPO run"),
                         ([*grpo[:4], "--num-generations", "3"], "--num-generations 3: must be >= 2 and divide"),
                         ([*grpo, "--loss-type", "ipo"], "--loss-type ipo with --generator")]:
        assert main([*job, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
