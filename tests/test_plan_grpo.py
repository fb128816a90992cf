"""The planner's count of a GRPO run (`grpo.planner_terms`, `plan.memory.engine_bytes`).

The reference: beta > 0 with full fine-tuning holds the frozen copy the trainer's `FullModel.reference` allocates (the
preference run's count, test_plan_preference.py checks it to the byte) and runs it forward each step; LoRA's is the
base itself; beta 0 holds none. The transformers engine: the model it builds holds the bytes counted, and generating a
batch whose longest prompt has `prompt_len` tokens and whose completions all run to the limit, its KV cache at the end
and its prompt pass's logits are the bytes counted, on a dense model and on an MoE one. The run's rank 0 holds it on
CPU ranks (pipeline stage 0, between steps, when the activations are gone); on GPUs it is in host memory.
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
from hfmeg.plan.memory import engine_bytes, stage_memory
from hfmeg.plan.profile import default_profile
from hfmeg.plan.search import Job, evaluate
from hfmeg.train.grpo import GRPOSettings


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
    assert job.reference_forward and job.reference_copy and job.engine == (16, 16, 32)
    plain = [stage_memory(cfg, lay, r, 8, 32, dtype_bytes=4) for r in range(2)]
    with_copy = [stage_memory(cfg, lay, r, 8, 32, dtype_bytes=4, reference_copy=True) for r in range(2)]
    assert all(c.frozen_weights > p.frozen_weights for c, p in zip(with_copy, plain))
    assert not GRPOSettings(reward_funcs=["accuracy"]).planner_terms(False, 8, 32)["reference_copy"]  # beta 0
    lora = GRPOSettings(reward_funcs=["accuracy"], beta=0.04).planner_terms(True, 8, 32)
    assert lora["reference_forward"] and not lora["reference_copy"]  # the base with the adapters off
    assert GRPOSettings(reward_funcs=["accuracy"], generator="vllm").planner_terms(False, 8, 32)["engine"] is None

    gpu = evaluate(job, lay).memory  # a GPU cluster: the engine is in host memory
    cpu_job = replace(job, profile=replace(job.profile, cores=2))  # a CPU profile (gloo ranks)
    stages = [stage_memory(cfg, lay, r, 8, 32, dtype_bytes=4, dense_mask=True, reference_copy=True,
                           engine=job.engine) for r in range(2)]
    weights, generating = engine_bytes(cfg, 16, 16, 32)
    assert (stages[0].engine_weights, stages[0].engine_generation) == (weights, generating)
    assert stages[1].engine_weights == stages[1].engine_generation == 0  # pipeline stage 1: not global rank 0
    assert stages[0].total == stages[0].measurable + weights + max(stages[0].transient,
                                                                    generating - stages[0].activations)
    assert gpu.engine_weights == 0 and evaluate(cpu_job, lay).memory.total == max(s.total for s in stages)
