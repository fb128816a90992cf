"""What a GRPO run holds for its rollouts beside the trained model, as the planner counts it (memory.py, global rank 0).

The trainer's `--layout auto` gets the terms from `GRPOSettings.planner_terms` (train/grpo.py), `hfmeg plan` from
its GRPO flags (`--generator`, `--num-generations`, `--max-completion-length`, `--beta`, ...); both through
`grpo_terms`, with the reference as a preference run's (`reference_forward`, `reference_copy`: beta > 0, a
frozen copy for full fine-tuning, LoRA's the base with the adapters off). What global rank 0 holds
(`rollout_memory`), as hfmeg starts the engines (train/rollout.py, generation/):
- the transformers engine, in rank 0's process on the CPU: the whole model in fp32 for the run and, while it
  generates a generation batch, its KV cache and its prompt pass's logits (`engine_bytes`);
- the vLLM engine, a process rank 0 starts, in fp32: on a CPU host the fp32 weights and the KV cache it is given,
  `VLLM_CPU_KVCACHE_SPACE` GiB (generation/vllm_engine.py, `cpu_kv_cache_gib`), beside which vLLM's CPU backend
  reserves nothing; on a GPU (rank 0's: the worker inherits its devices), what vLLM reserves at start for
  everything it holds, weights, activations and KV cache, whatever the model: `vllm_gpu_memory_utilization` of
  the GPU's memory (TRL's setting, hfmeg passes it to vLLM);
- the HF folder the weights are exported to for the engine (`/dev/shm/hfmeg-rollout-*`: every push for vLLM, the
  first for the transformers engine, kept for the run): the whole model once in the training dtype, in host
  memory.
On CPU ranks all of it is rank 0's memory; on GPUs only vLLM's share is the GPU's, and the rest is host memory
(`Memory.rollouts_host`), outside the GPU's count. Not counted: the engines' runtimes (libraries, a CUDA context),
the whole model gathered on rank 0 while a push lasts, and the time of the push and of generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..config import ModelConfig
from ..generation.vllm_engine import cpu_kv_cache_gib
from ..models.decoder import ModelChunk
from ..parallel.grid import RankGrid

GIB = 2**30
VLLM_GPU_MEMORY_UTILIZATION = 0.3  # TRL's default for a vLLM beside the training on its GPU (GRPOSettings')


@dataclass(frozen=True)
class RolloutTerms:
    """A GRPO run's rollouts: its engine, the completions it generates at once (a generation batch), its prompts'
    longest (`seq_len` − `max_completion_length`) and its rows' (`seq_len`) token counts, and vLLM's share of a GPU."""

    generator: Literal["transformers", "vllm"]
    completions: int
    prompt_len: int
    seq_len: int
    vllm_gpu_memory_utilization: float = VLLM_GPU_MEMORY_UTILIZATION


def grpo_terms(*, generator: str, beta: float, adapters: bool, global_batch_size: int, generation_steps: int,
               seq_len: int, max_completion_length: int, vllm_gpu_memory_utilization: float) -> dict:
    """The planner's `Job` fields of a GRPO run (module doc)."""
    rollouts = RolloutTerms(generator, global_batch_size * generation_steps, seq_len - max_completion_length,
                            seq_len, vllm_gpu_memory_utilization)
    return dict(reference_forward=beta > 0, reference_copy=beta > 0 and not adapters, rollouts=rollouts)


def model_parameters(cfg: ModelConfig) -> int:
    """The whole model's parameters as an HF folder stores them (unsharded, the vocabulary unpadded, tied embeddings
    once), counted on the real `ModelChunk` built on the meta device; once per configuration (a search asks it for
    every layout, and a 70B model's chunk takes a tenth of a second)."""
    key = repr(cfg)
    if key not in _PARAMETERS:
        with torch.device("meta"):
            chunk = ModelChunk(cfg, RankGrid().place(0), range(cfg.num_layers), pre_process=True, post_process=True,
                               vocab_multiple=1)
        _PARAMETERS[key] = sum(p.numel() for p in chunk.parameters())
    return _PARAMETERS[key]


_PARAMETERS: dict[str, int] = {}


def engine_bytes(cfg: ModelConfig, completions: int, prompt_len: int, seq_len: int) -> tuple[int, int]:
    """The in-process transformers engine generating `completions` at once, prompts of up to `prompt_len` tokens, rows
    of up to `seq_len` (generation/transformers_engine.py): (its model: every parameter of the whole model in fp32;
    what generating holds: the fp32 keys and values of every layer that keeps its own, for each row's `seq_len` − 1
    positions (the last sampled token is never fed back), plus the prompt pass's fp32 logits, `completions` ×
    `prompt_len` × vocabulary). A layer's cache is counted at full length (a sliding window's included); MLA's and
    linear attention's states are not modelled apart."""
    per_position = sum(2 * shape.num_kv_heads * shape.head_dim for shape in map(cfg.attention_shape,
                                                                                range(cfg.num_layers))
                       if not shape.reused)
    return 4 * model_parameters(cfg), 4 * completions * ((seq_len - 1) * per_position + prompt_len * cfg.vocab_size)


@dataclass(frozen=True)
class RolloutMemory:
    """Bytes global rank 0 holds for the rollouts: on its device for the run, on it while the transformers engine
    generates (between steps, when the step's activations are gone), and in host memory outside a GPU's count."""

    held: int = 0
    generating: int = 0
    host: int = 0


def rollout_memory(cfg: ModelConfig, terms: RolloutTerms, dtype_bytes: int, gpu_bytes: float | None) -> RolloutMemory:
    """What `terms`' rollouts hold (module doc); `gpu_bytes`: the GPU's memory, None for CPU ranks (gloo)."""
    export = dtype_bytes * model_parameters(cfg)
    if terms.generator == "vllm":
        if gpu_bytes is not None:
            return RolloutMemory(held=int(terms.vllm_gpu_memory_utilization * gpu_bytes), host=export)
        return RolloutMemory(held=4 * model_parameters(cfg) + cpu_kv_cache_gib() * GIB + export)
    weights, generating = engine_bytes(cfg, terms.completions, terms.prompt_len, terms.seq_len)
    if gpu_bytes is not None:  # the engine runs on the CPU (train/rollout.py gives it no device)
        return RolloutMemory(host=weights + generating + export)
    return RolloutMemory(held=weights + export, generating=generating)
