"""Per-GPU memory of one training step: what the runtime really allocates, counted.

- Parameters: the rank's chunks are built on the `meta` device with the real
  `ModelChunk` (so TP splits, vocabulary padding, tied embeddings and biases are
  the model's own), and cut into buckets by the data-parallel wrapper's own `plan_buckets`
  (so DP padding is exact). The distributed optimizer then holds, per padded
  element: the parameter buffer (model dtype), the fp32 main-gradient buffer, and
  fp32 master + exp_avg + exp_avg_sq over its 1/DP shard (all of it for `ddp`).
  With expert parallelism the chunk is built for EP rank 0, so it holds E/EP whole
  experts, and the routed experts go into buckets of their own (`buffers.bucket_parts`,
  as the wrapper cuts them) whose state is sharded over the expert-DP group (DP/EP
  ranks) instead of DP.
- Context parallelism: a CP rank holds its s/cp tokens of every row (activations.py)
  and 1/(DP x CP) of the optimizer state, which is sharded over DP x CP.
- Activations: `activations.chunk_bytes` per micro-batch and chunk, summed over
  the micro-batches the schedule keeps in flight. In-flight counts come from the
  schedule's plan itself (`schedules.plan`), so GPipe, 1F1B's pp - r and the
  interleaved warm-up are exact by construction, uneven layer splits included.
- LoRA/DoRA (`peft`): the meta chunk gets its adapters (`peft.adapters.attach`, which
  freezes the base), so buffers, main grads and optimizer state count the adapters only,
  and the frozen base is counted apart (`frozen_weights`, model dtype, no fp32 copy); a 4-bit base's linears
  and routed experts (`peft.quantize`, the weights `rules_4bit.stored_4bit` picks; the experts the EP rank holds)
  at their codes and absmax as the rank holds them (`rules_4bit.held_4bit_bytes`).
  Activations are still full fine-tuning's count (not re-measured with adapters).
- A preference run's frozen reference copy (full fine-tuning, `reference_copy`): the chunk's
  parameters once more in the model dtype, counted in `frozen_weights`. Its forward runs before the
  policy's, without autograd, so it adds no saved activations (a layer's transients only, below
  the recompute and cross-entropy transients counted). LoRA's reference is the base itself: nothing.
- A GRPO run's rollouts (`rollouts`, plan/rollout.py), on global rank 0 (pipeline stage 0): what its generation
  engine and the weights' export folder hold on the rank's device for the run (`rollouts_held`: on CPU ranks the
  engine's fp32 model, vLLM's KV cache and the folder; on a GPU vLLM's reserved share of it), what the transformers
  engine holds while it generates, between steps when no activation is held (`rollouts_generating`), and, on GPUs,
  what they hold in host memory outside the GPU's count (`rollouts_host`).
- Transients the saved-tensor meter cannot see: one layer recomputed in backward,
  and the chunked cross-entropy's fp32 logits (forward and backward hold two
  `chunk_tokens x V/tp` buffers) plus a head-weight-sized gradient in the model
  dtype (fp32: its accumulator; 16-bit: the zero gradient autograd gets while the
  products go straight into the fp32 main gradient).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import lru_cache

import torch

from ..checkpoint.rules import chunk_rules
from ..checkpoint.rules_4bit import held_4bit_bytes, stored_4bit
from ..config import ModelConfig
from ..models.decoder import ModelChunk
from ..optim.config import OptimizerConfig
from ..parallel.buffers import bucket_parts, plan_buckets
from ..parallel.grid import RankGrid
from ..parallel.layout import rank_chunks, split_layers
from ..parallel.linear_cross_entropy import CE_CHUNK_TOKENS
from ..parallel.roles import named_roles
from ..parallel.schedules import plan
from ..parallel.stored_names import stored_tensors
from ..peft.adapters import attach
from ..peft.config import PeftConfig
from .activations import Shape, chunk_bytes, received_input_bytes, recompute_transient_bytes
from .fp8 import fp8_copy_bytes
from .layout import PlanLayout
from .rollout import RolloutMemory, RolloutTerms, rollout_memory


@dataclass(frozen=True)
class Memory:
    """Bytes on the busiest pipeline stage."""

    stage: int
    params: int  # elements on this rank, bucket padding included
    param_buffer: int
    grad_buffer: int
    optimizer_state: int
    activations: int  # peak saved for backward over the schedule
    transient: int
    buckets: int = 1  # gradient buckets on this rank (each costs a collective and an AdamW call per step)
    expert_padded: int = 0  # of `params`' padded elements, those in expert buckets (summed over expert-DP, not DP)
    expert_buckets: int = 0  # of `buckets`, the expert buckets
    tp_summed: int = 0  # owned gradient elements summed over TP after the DP sum (SP norms, MoE weights)
    frozen_weights: int = 0  # bytes of parameters no optimizer holds (a LoRA run's base, a reference copy)
    rollouts_held: int = 0  # a GRPO run's engine and export folder, on global rank 0 (plan/rollout.py)
    rollouts_generating: int = 0  # what its transformers engine holds while it generates, between steps
    rollouts_host: int = 0  # what they hold in rank 0's node's host memory, outside a GPU's count (not in `total`)

    @property
    def measurable(self) -> int:
        """What the CPU check measures: saved-tensor meter peak + optimizer buffers and state (+ a frozen base)."""
        return self.param_buffer + self.grad_buffer + self.optimizer_state + self.activations + self.frozen_weights

    @property
    def total(self) -> int:
        # the engine generates between steps, when the step's activations and transients are gone
        return self.measurable + self.rollouts_held + max(self.transient, self.rollouts_generating - self.activations)

    def to_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


@dataclass(frozen=True)
class _Elements:
    """One chunk's parameters on one rank, as the data-parallel wrapper lays them out."""

    params: int
    padded: int  # bucket elements, padding included
    expert_padded: int  # of which in expert buckets
    buckets: int
    expert_buckets: int
    tp_summed: int  # owned elements of sequence-parallel-role parameters (summed over TP when TP > 1)
    frozen: int = 0  # elements that do not require grad (a LoRA run's base)
    four_bit: int = 0  # of which stored 4-bit (a QLoRA run's base linears)
    four_bit_bytes: int = 0  # what the rank holds of those

    def __add__(self, o: "_Elements") -> "_Elements":
        return _Elements(*(a + b for a, b in zip(asdict(self).values(), asdict(o).values())))


_ELEMENTS: dict[tuple, _Elements] = {}  # the search asks for the same chunks many times


def _cfg_key(cfg: ModelConfig) -> str:
    return repr(sorted(cfg.to_dict().items()))


def _chunk_elements(cfg: ModelConfig, lay: PlanLayout, layers: range, pre: bool, post: bool,
                    bucket_size: int, peft: PeftConfig | None) -> _Elements:
    # Dense layers are alike, so the count depends on how many; MoE models mix dense and sparse layers.
    which = tuple(cfg.is_sparse(i) for i in layers) if cfg.moe else len(layers)
    key = (_cfg_key(cfg), lay.tp, lay.sp, lay.ep, which, pre, post, lay.pp, _shards(lay), bucket_size,
           lay.vocab_multiple,
           repr(peft) if peft is not None and peft.enabled else None)
    if key not in _ELEMENTS:
        _ELEMENTS[key] = _count_chunk(cfg, lay, layers, pre, post, bucket_size, peft)
    return _ELEMENTS[key]


def _shards(lay: PlanLayout) -> tuple[int, int | None]:
    """(DP shards of a dense bucket, of an expert bucket or None when experts are ordinary: EP 1),
    as data_parallel.DataParallel chooses them: over DP x CP, and expert-DP x CP."""
    sharded = lay.optimizer != "ddp"
    return (lay.replicas if sharded else 1), ((lay.edp * lay.cp if sharded else 1) if lay.ep > 1 else None)


def _count_chunk(cfg: ModelConfig, lay: PlanLayout, layers: range, pre: bool, post: bool,
                 bucket_size: int, peft: PeftConfig | None) -> _Elements:
    # TP and EP rank 0 of a grid without CP: the parameters are the same at any CP
    ps = RankGrid(tp=lay.tp, dp=lay.ep, ep=lay.ep, sequence_parallel=lay.sp).place(0)
    with torch.device("meta"):
        chunk = ModelChunk(cfg, ps, layers, pre_process=pre, post_process=post, vocab_multiple=lay.vocab_multiple)
        if peft is not None and peft.enabled:
            attach(chunk, peft)
    named = [(n, p, r) for n, p, r in named_roles(chunk) if p.requires_grad][::-1]
    frozen = sum(p.numel() for p in chunk.parameters() if not p.requires_grad)
    four_bit = four_bit_bytes = 0
    if peft is not None and peft.enabled and peft.quantize:
        params = stored_tensors(chunk)  # the grouped experts per expert, as their rules name them
        rules = chunk_rules(cfg, layers, pre, post, chunk.experts)
        four_bit = sum(params[r.local].numel() for r in rules if stored_4bit(r, cfg))
        four_bit_bytes = held_4bit_bytes(cfg, rules, lay.tp, 0, lay.ep, 0, peft.double_quant, lay.vocab_multiple)
    total = _Elements(sum(p.numel() for _, p, _ in named), 0, 0, 0, 0, 0, frozen, four_bit, four_bit_bytes)
    for part, shards, expert in bucket_parts(named, *_shards(lay)):
        buckets = plan_buckets(part, lay.pp, bucket_size, shards, 0, 0, expert)
        padded = sum(b.size for b in buckets)
        summed = sum(hi - lo for b in buckets for lo, hi, sp in b.runs(0, lambda s: s.role.sequence_parallel)
                     if sp) if lay.tp > 1 else 0
        total += _Elements(0, padded, padded if expert else 0, len(buckets), len(buckets) if expert else 0, summed)
    return total


def _in_flight_peak(lay: PlanLayout, pp_rank: int, microbatches: int, per_chunk: list[int]) -> int:
    """Peak of the saved bytes over this rank's plan (forwards add a chunk's bytes, backwards free them)."""
    if lay.schedule == "gpipe":
        return microbatches * sum(per_chunk)
    # 1F1B and interleaved reach their steady state within a few rounds of pp micro-batches and repeat
    # it after, so a longer step has the same peak: simulate at most 4·pp micro-batches (a multiple of pp).
    return _simulated_peak(lay.schedule, lay.pp, pp_rank, lay.vpp, min(microbatches, 4 * lay.pp), tuple(per_chunk))


@lru_cache(maxsize=65536)
def _simulated_peak(schedule: str, pp: int, pp_rank: int, vpp: int, microbatches: int, per_chunk: tuple) -> int:
    live = peak = 0
    for step in plan(schedule, pp, pp_rank, vpp, microbatches):
        for a in step:
            live += per_chunk[a.chunk] if a.kind == "F" else -per_chunk[a.chunk]
            peak = max(peak, live)
    return peak


def plan_shape(lay: PlanLayout, seq_len: int, dtype_bytes: int, dense_mask: bool = False) -> Shape:
    """The activation shape of one micro-batch of `lay` (`dense_mask`: attention on the CPU path)."""
    return Shape(lay.micro_batch, seq_len, lay.tp, lay.sp, dtype_bytes, lay.recompute, lay.ep, lay.cp, dense_mask)


def stage_memory(cfg: ModelConfig, lay: PlanLayout, pp_rank: int, global_batch: int, seq_len: int,
                 dtype_bytes: int = 2, opt: OptimizerConfig | None = None, peft: PeftConfig | None = None,
                 dense_mask: bool = False, reference_copy: bool = False, fp8: bool = False,
                 rollouts: RolloutTerms | None = None, gpu_bytes: float | None = None) -> Memory:
    """`dense_mask`: the CPU path's attention (activations.Shape.dense_mask); `reference_copy`: a preference
    run's frozen reference model beside the trained one; `fp8`: the decoder linears run in FP8 (`model.fp8`: their
    operands' FP8 copies, plan/fp8.py); `rollouts`: a GRPO run's, held by pipeline stage 0 (global rank 0) on its GPU
    of `gpu_bytes` (None: a CPU rank), `rollout.rollout_memory`."""
    opt = opt or OptimizerConfig(mode=lay.optimizer)
    shards, expert_shards = _shards(lay)
    shape = plan_shape(lay, seq_len, dtype_bytes, dense_mask)
    specs = rank_chunks(split_layers(cfg.num_layers, lay.pp, lay.vpp), pp_rank)
    el = _Elements(0, 0, 0, 0, 0, 0)
    per_chunk = []
    for s in specs:
        el += _chunk_elements(cfg, lay, s.layers, s.pre_process, s.post_process, opt.bucket_size, peft)
        held = chunk_bytes(cfg, shape, s.layers, s.pre_process, s.post_process)
        per_chunk.append(held + (0 if s.pre_process else received_input_bytes(cfg, shape)))
    activations = _in_flight_peak(lay, pp_rank, lay.microbatches(global_batch), per_chunk)
    transient = recompute_transient_bytes(cfg, shape) + (fp8_copy_bytes(cfg, shape) if fp8 else 0)
    if any(s.post_process for s in specs):
        vocab = cfg.padded_vocab(lay.tp, lay.vocab_multiple) // lay.tp
        ce = 2 * min(CE_CHUNK_TOKENS, lay.micro_batch * shape.seq) * vocab * 4 + vocab * cfg.hidden_size * dtype_bytes
        transient = max(transient, ce)
    dense = el.padded - el.expert_padded
    state = 12 * (dense // shards + el.expert_padded // (expert_shards or shards))
    roll = rollout_memory(cfg, rollouts, dtype_bytes, gpu_bytes) if rollouts is not None else RolloutMemory()
    if pp_rank != 0:  # the host memory is rank 0's node's, which every stage's report names
        roll = RolloutMemory(host=roll.host)
    return Memory(pp_rank, el.params, dtype_bytes * el.padded, 4 * el.padded, state, activations, transient,
                  el.buckets, el.expert_padded, el.expert_buckets, el.tp_summed,
                  dtype_bytes * (el.frozen - el.four_bit + reference_copy * el.params) + el.four_bit_bytes,
                  roll.held, roll.generating, roll.host)


def stage_memories(cfg: ModelConfig, lay: PlanLayout, global_batch: int, seq_len: int, dtype_bytes: int = 2,
                   opt: OptimizerConfig | None = None, peft: PeftConfig | None = None,
                   dense_mask: bool = False, reference_copy: bool = False, fp8: bool = False,
                   rollouts: RolloutTerms | None = None, gpu_bytes: float | None = None) -> list[Memory]:
    return [stage_memory(cfg, lay, r, global_batch, seq_len, dtype_bytes, opt, peft, dense_mask, reference_copy, fp8,
                         rollouts, gpu_bytes) for r in range(lay.pp)]


def memory(cfg: ModelConfig, lay: PlanLayout, global_batch: int, seq_len: int, dtype_bytes: int = 2,
           opt: OptimizerConfig | None = None) -> Memory:
    """The pipeline stage that needs the most memory."""
    return max(stage_memories(cfg, lay, global_batch, seq_len, dtype_bytes, opt), key=lambda m: m.total)
