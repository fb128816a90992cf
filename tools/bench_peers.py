"""hfmeg side by side with transformers, torchtitan and Megatron-Core: same device, shapes, tokens and batch, one run.

Rows (`--systems` picks some; all by default):

- `hfmeg`: bench_mfu's hfmeg path (forward_backward + the overlapped DistributedOptimizer, fp32 master weights,
  fp32 main grads and moments; Inductor-fused norm/RoPE/SwiGLU with `--compile`, the default on CUDA);
- `transformers`, `transformers-compiled`: bench_mfu's anchor (SDPA, `AdamW(fused=True)` on the params, no fp32
  master; a Mixtral runs its default experts implementation), eager and under `torch.compile`;
- `torchtitan` (0.3.x): its Llama 3 model built from its own layer configs at these shapes (a Mixtral: its Qwen3-MoE
  layers without QK-norm, top-k softmax router, no load balancing), its `parallelize_*` with FSDP2 on a mesh of one
  (fp32 parameters, bf16 compute through FSDP2's MixedPrecisionPolicy, fp32 reduce), its compile settings (per
  block and the loss, `--compile`), its ChunkedLossWrapper over its CrossEntropyLoss (the LM head inside the loss),
  its OptimizersContainer from `default_adamw` (fused AdamW) and its clip_grad_norm_; FlexAttention (its LM
  default) on CUDA, with its block-causal document mask on packed rows, its SDPA module on CPU, where torch has no
  FlexAttention backward; on torch 2.11 through tools/peer_shims.py;
- `megatron-core` (0.19.x): `GPTModel` with the Transformer Engine spec where TE imports, else the local spec with
  torch's SDPA as core attention (peer_shims.SdpaCoreAttention; the local DotProductAttention materialises the scores
  in fp32), `DistributedDataParallel` (fp32 grad buffer, overlapped reduce) + the distributed optimizer (fp32 main
  params; TE/apex FusedAdam, else torch's AdamW on its fused kernel), per-token loss through its no-pipelining
  schedule, gradient-accumulation fusion where apex's CUDA extension imports; unpacked rows (packed documents need
  TE's THD attention); MoE: its `SequentialMLP` experts, top-k router, no aux loss. CUDA only (its grad buffers and
  schedule are).

A peer that is not installed (or cannot run here) keeps its JSON row with `"skipped": reason` and one line
`skip NAME: reason` on stderr. The peers are never dependencies of hfmeg: `tools/peer_wheels.sh` downloads them, and
`tools/gpu_loan.py` runs them on a GPU loan (docs/gpu.md).

Every system trains the same token ids (bench_mfu.make_batches) with the same global batch (`--grad-accum` ×
`--micro-batch-size` × `--seq`), AdamW lr 3e-4, betas 0.9/0.95, weight decay 0.1 off the norms, clipping at 1.0.
Round r runs every system once (build, `--warmup` untimed steps, `--steps` timed steps, free), in an order rotated by
r so that none always runs first; `--repeats` rounds. Each row reports the median, min and max of tokens/s over its
rounds, the MFU of the median, and the largest CUDA peak (`max_memory_allocated` from after its build). MFU is
bench_mfu's: Megatron-LM's FLOP count (`hfmeg.plan.flops.training_flops`; attention counted over the full s × s
score matrix, not the causal half; an MoE counts the router and its top-k experts), against the GPU's dense bf16 peak.
The last line is a summary with each row's median tokens/s as a ratio to hfmeg's.

    .venv/bin/python tools/bench_peers.py                   # GPU: 4 LLaMA-2-7B layers, seq 4096; CPU: tiny shapes
    .venv/bin/python tools/bench_peers.py --layers 2 --ffn 14336 --experts 8 --top-k 2
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hfmeg.checkpoint.tensor_source import TensorSource
from hfmeg.families import model_config_from_hf
from hfmeg.data.packing import IGNORE
from hfmeg.models.random_init import random_hf_model
from hfmeg.plan.flops import mfu, training_flops
from bench_args import at_least
from bench_mfu import (OPTIM, SideResult, _free, _measure, bench_device, build_hf, build_hfmeg, hf_config,
                       make_batches, peak_flops_of, resolve_args, run_main, settings, shape_parser)
from peer_shims import SdpaCoreAttention, apply_torchtitan_shims, fuse_torch_adamw

FLOP_CONVENTION = ("Megatron-LM: 6 x matmul parameters a token goes through (+ LM head) + 12 s l h attention "
                   "(full s x s scores, not the causal half); recompute not counted")
# Five systems x three rounds of 7B-shape layers fit a GPU checklist part only at a few layers.
GPU_DEFAULTS = dict(layers=4, steps=4, warmup=2)


@dataclass
class Bench:
    """What every system of one run shares."""
    a: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    shapes: dict
    batches: list
    source: TensorSource  # the random weights hfmeg and transformers start from (HF's own initialisation)

    @property
    def bf16(self) -> bool:
        return self.dtype == torch.bfloat16

    @property
    def compute(self) -> str:
        return "bf16" if self.bf16 else "fp32"

    def global_tokens(self, i: int) -> int:
        """Loss tokens of global batch i: every system divides its summed loss by this."""
        return sum(mb.label_tokens() for mb in self.batches[i])


@dataclass
class System:
    name: str
    package: str | None  # the distribution whose version the row records (None: this checkout)
    precision: Callable[[Bench], str]
    settings: Callable[[Bench], str]
    unavailable: Callable[[Bench], str | None]  # why it cannot run here, None when it can
    build: Callable[[Bench], Callable[[int], tuple[float, int]]]  # model + optimizer; step(i) -> (loss, tokens)
    packed: bool = True  # whether it attends within documents of packed rows (else rows must be unpacked)

    def run(self, b: Bench) -> SideResult:
        """Build, warm up, time, then leave nothing behind."""
        return _measure(self.build(b), b.a, b.device)


def _missing(module: str) -> str | None:
    """The skip reason of a peer whose top-level module does not import here."""
    try:
        importlib.import_module(module)
    except Exception as e:  # ImportError, or an installed peer that fails at import (a missing dependency)
        return f"not installed or not importable ({type(e).__name__}: {str(e).splitlines()[0]})"
    return None


# --- hfmeg and transformers: bench_mfu's two sides -------------------------------------------------------------------

def _build_transformers(compiled: bool):
    def build(b: Bench):
        model = random_hf_model(hf_config(b.shapes), seed=b.a.seed, dtype=b.dtype, device=b.device)
        return build_hf(model, b.batches, argparse.Namespace(**{**vars(b.a), "hf_compile": compiled}), b.device)
    return build


def _experts_impl(b: Bench) -> str:
    """What transformers picks for the installed torch (grouped_mm where it has it), read off a model on meta."""
    if not b.a.experts:
        return ""
    model = random_hf_model(hf_config(b.shapes), seed=b.a.seed, dtype=b.dtype, device="meta")
    return f"experts={model.config._experts_implementation}, "


HFMEG = System(
    "hfmeg", None,
    precision=lambda b: f"{b.compute} params; fp32 master weights, fp32 main grads, fp32 AdamW moments",
    settings=lambda b: f"compile={'inductor' if b.a.compile else 'none'}, chunked CE, overlapped "
                       "DistributedOptimizer, fused AdamW, "
                       f"{'document-causal' if b.a.trainer_path else 'causal'} attention",
    unavailable=lambda b: None,
    build=lambda b: build_hfmeg(b.source, b.batches, b.a, b.device, b.dtype),
)
# hfmeg with its linears in FP8 (`model.fp8`, torchao's tensorwise recipe; docs/fp8.md): not a peer, the FP8 row of
# tools/gpu_loan.py (row4) sets it beside hfmeg's bf16 side, so it is not in SYSTEMS.
HFMEG_FP8 = System(
    "hfmeg-fp8", "torchao",
    precision=lambda b: f"{b.compute} params, linears' GEMMs in FP8 (torchao tensorwise: e4m3 weights and "
                        "activations, e5m2 gradients; emulated off FP8 hardware); fp32 master weights and main grads",
    settings=HFMEG.settings,
    unavailable=lambda b: None if _have("torchao") else "torchao is not installed (pip install 'hfmeg[fp8]')",
    build=lambda b: build_hfmeg(b.source, b.batches, b.a, b.device, b.dtype, fp8="tensorwise"),
)
TRANSFORMERS = [System(
    "transformers-compiled" if compiled else "transformers", "transformers",
    precision=lambda b: f"{b.compute} params, grads and AdamW moments; no fp32 master",
    settings=lambda b, c=compiled: f"sdpa, {_experts_impl(b)}fused AdamW, clip foreach, torch.compile={c}",
    unavailable=lambda b: None,
    build=_build_transformers(compiled),
) for compiled in (False, True)]


# --- torchtitan ------------------------------------------------------------------------------------------------------

def _torchtitan_unavailable(b: Bench) -> str | None:
    apply_torchtitan_shims()  # before torchtitan's first import: it binds the names at import
    return _missing("torchtitan.models.llama3")


def _torchtitan_model(b: Bench):
    """torchtitan's model config at the bench's shapes, from its own layer builders (the flavours hard-code theirs),
    and its parallelize function. A Mixtral is its Qwen3-MoE decoder less Qwen3's QK-norm."""
    from torchtitan.models.common import CosSinRoPE, ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    sh = b.shapes
    h, head_dim = sh["hidden"], sh["hidden"] // sh["heads"]
    common = dict(n_layers=sh["layers"], dim=h, n_heads=sh["heads"], n_kv_heads=sh["heads"], attn_backend="flex")
    if sh["experts"]:
        from torchtitan.models.qwen3 import (_EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm,
                                             parallelize_qwen3)
        from torchtitan.models.qwen3.model import Qwen3Model
        layers = _build_qwen3_moe_layers(**common, head_dim=head_dim, moe_hidden_dim=sh["ffn"],
                                         num_experts=sh["experts"], top_k=sh["top_k"], moe_comm_backend="standard",
                                         rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=sh["seq"], theta=1e4))
        for layer in layers:
            layer.attention.qk_norm = None  # Mixtral has none
            layer.moe.load_balance_coeff = None  # nor does any other row balance the load
        config = Qwen3Model.Config(
            dim=h, vocab_size=sh["vocab"], norm=_qwen3_norm(h), layers=layers,
            tok_embeddings=Embedding.Config(num_embeddings=sh["vocab"], embedding_dim=h, param_init=_EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=h, out_features=sh["vocab"], param_init=_LINEAR_INIT))
        parallelize = parallelize_qwen3
    else:
        from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, Llama3Model, _build_llama3_layers,
                                              _output_linear_init, parallelize_llama)
        layers = _build_llama3_layers(**common, hidden_dim=sh["ffn"],  # LLaMA-2's RoPE: theta 1e4, no scaling
                                      rope=ComplexRoPE.Config(dim=head_dim, max_seq_len=sh["seq"], theta=1e4,
                                                              scaling="none"))
        config = Llama3Model.Config(
            dim=h, vocab_size=sh["vocab"], norm=RMSNorm.Config(normalized_shape=h, param_init=_NORM_INIT),
            layers=layers,
            tok_embeddings=Embedding.Config(num_embeddings=sh["vocab"], embedding_dim=h, param_init=_EMBEDDING_INIT),
            lm_head=Linear.Config(in_features=h, out_features=sh["vocab"], param_init=_output_linear_init(h)))
        parallelize = parallelize_llama
    if b.device.type == "cpu":
        for layer in layers:  # torch has no FlexAttention backward on CPU; one causal document per row is the same
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config, parallelize


def _build_torchtitan(b: Bench):
    """torchtitan as its llama3_8b trainer config runs it, less what would change the work (no selective AC, as no
    other row recomputes): its model and parallelize function (FSDP2 on a world of one, bf16 compute through its
    MixedPrecisionPolicy, per-block compile), its ChunkedLossWrapper over its CrossEntropyLoss (8 chunks, the LM head
    inside the loss; the loss compiled with the model), its OptimizersContainer with default_adamw (fused AdamW,
    weight decay 0.1 on every parameter) and its clip_grad_norm_. Packed rows: its block-causal document mask from
    the positions (flex attention on CUDA)."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import parallel_dims as titan_dims
    from torchtitan.distributed import utils as titan_dist

    config, parallelize = _torchtitan_model(b)
    if b.device.type == "cpu":
        titan_dims.device_type = "cpu"  # torchtitan falls back to "cuda" for its meshes when no accelerator exists
    parallelism = ParallelismConfig()
    dims = ParallelDims.from_config(parallelism, world_size=1)
    with torch.device("meta"):
        model = config.build()
    training = TrainingConfig(mixed_precision_param="bfloat16" if b.bf16 else "float32",
                              mixed_precision_reduce="float32", seq_len=b.a.seq)
    compile_config = CompileConfig(enable=b.a.compile, components=["model", "loss"])
    model = parallelize(model, parallel_dims=dims, training=training, parallelism=parallelism,
                        compile_config=compile_config, ac_config=None, dump_folder=os.devnull)
    model.to_empty(device=b.device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=b.shapes["vocab"])).build(
        compile_config=compile_config)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True  # as its trainer does with the chunked loss: the head runs inside the loss
    params = list(model.parameters())
    opt = default_adamw(lr=OPTIM.lr).build(model_parts=[model])
    flex = b.device.type == "cuda"

    def step(i):
        total = torch.zeros((), device=b.device)
        n = torch.tensor(b.global_tokens(i), device=b.device)
        for mb in b.batches[i]:
            ids = mb.input_ids
            positions = (mb.position_ids if mb.position_ids is not None
                         else torch.arange(ids.shape[1], device=b.device).expand_as(ids))
            # as its trainer does per micro-batch: block-causal masks from the positions (documents reset them)
            masks = model.get_attention_masks(positions) if flex else None
            hidden = model(ids, positions=positions, attention_masks=masks)
            loss, _ = loss_fn(hidden, mb.labels, n, positions=positions)
            loss.backward()
            total += loss.detach()
        titan_dist.clip_grad_norm_(params, OPTIM.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad()
        return total.item(), sum(mb.input_ids.numel() for mb in b.batches[i])

    return step


TORCHTITAN = System(
    "torchtitan", "torchtitan",
    precision=lambda b: f"fp32 params (FSDP2 shards), {b.compute} compute (MixedPrecisionPolicy), fp32 grads "
                        "and reduce, fp32 AdamW moments",
    settings=lambda b: f"{'Qwen3-MoE layers without QK-norm' if b.a.experts else 'Llama 3 model'}, FSDP2 world of "
                       f"one, compile={b.a.compile} (model per block + loss), "
                       f"attention={'flex, document mask' if b.device.type == 'cuda' else 'sdpa, causal over the row'}"
                       ", ChunkedLossWrapper(8), OptimizersContainer default_adamw (fused, wd 0.1 on all), "
                       "its clip_grad_norm_",
    unavailable=_torchtitan_unavailable,
    build=_build_torchtitan,
)


# --- Megatron-Core ---------------------------------------------------------------------------------------------------

def _megatron_unavailable(b: Bench) -> str | None:
    missing = _missing("megatron.core.models.gpt")
    if missing or b.device.type == "cuda":
        return missing
    return ("its DistributedDataParallel allocates grad buffers on torch.cuda.current_device() "
            "(megatron/core/distributed/param_and_grad_buffer.py) and its schedules and RoPE create CUDA tensors: "
            "CUDA only")


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _megatron_parallel_state():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
        model_parallel_cuda_manual_seed(0)  # its TP layers initialise weights under this RNG tracker


def _build_megatron(b: Bench):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    _megatron_parallel_state()
    sh = b.shapes
    config = _megatron_config(b)
    model = GPTModel(config, _megatron_spec(b), vocab_size=sh["vocab"], max_sequence_length=sh["seq"],
                     position_embedding_type="rope", rotary_base=10000, share_embeddings_and_output_weights=False)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=True, use_distributed_optimizer=True), module=model)
    # As megatron.training wires them: micro-batches but the last skip the grad sync, and the finaliser divides
    # the summed grads by the global token count (per-token loss).
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=OPTIM.lr, weight_decay=OPTIM.weight_decay, adam_beta1=OPTIM.beta1,
        adam_beta2=OPTIM.beta2, adam_eps=OPTIM.eps, clip_grad=OPTIM.grad_clip, bf16=b.bf16, params_dtype=b.dtype,
        use_distributed_optimizer=True), [ddp])
    if not _megatron_fused_optimizer():
        fuse_torch_adamw(opt)  # its fallback to torch's AdamW, on torch's fused kernel
    forward_backward = get_forward_backward_func()

    def forward_step(data, m):
        mb = next(data)
        ids, labels = mb.input_ids, mb.labels
        mask = labels != IGNORE
        positions = torch.arange(ids.shape[1], device=b.device).expand_as(ids)
        # Its vocabulary-parallel CE needs a valid id everywhere; the mask drops the ignored ones.
        per_token = m(ids, positions, None, labels=labels.masked_fill(~mask, 0))

        def loss(out):
            total = (out.float() * mask).sum()
            return total, mask.sum().to(torch.int), {"loss": total.detach()}
        return per_token, loss

    def step(i):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = forward_backward(forward_step_func=forward_step, data_iterator=iter(b.batches[i]), model=[ddp],
                               num_microbatches=len(b.batches[i]), seq_length=sh["seq"],
                               micro_batch_size=sh["micro_batch_size"], forward_only=False)
        opt.step()
        return (float(sum(o["loss"] for o in out)) / b.global_tokens(i),
                sum(mb.input_ids.numel() for mb in b.batches[i]))

    return step


def _megatron_config(b: Bench):
    from megatron.core.transformer import TransformerConfig

    sh = b.shapes
    moe = dict(num_moe_experts=sh["experts"], moe_router_topk=sh["top_k"], moe_ffn_hidden_size=sh["ffn"],
               moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
               moe_router_pre_softmax=False) if sh["experts"] else {}
    return TransformerConfig(
        num_layers=sh["layers"], hidden_size=sh["hidden"], ffn_hidden_size=sh["ffn"],
        num_attention_heads=sh["heads"], num_query_groups=sh["heads"], normalization="RMSNorm",
        layernorm_epsilon=1e-5, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=b.bf16, params_dtype=b.dtype, pipeline_dtype=b.dtype,
        gradient_accumulation_fusion=_megatron_wgrad_fusion(), calculate_per_token_loss=True, **moe)


def _megatron_spec(b: Bench):
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    te = _have("transformer_engine")
    spec = get_gpt_layer_with_transformer_engine_spec if te else get_gpt_layer_local_spec
    if b.shapes["experts"]:
        spec = spec(num_experts=b.shapes["experts"], moe_grouped_gemm=False, normalization="RMSNorm")
    else:
        spec = spec(normalization="RMSNorm")
    if not te:  # the local spec's DotProductAttention materialises the scores in fp32: torch's SDPA instead
        spec.submodules.self_attention.submodules.core_attention = SdpaCoreAttention
    return spec


def _megatron_fused_optimizer() -> bool:
    """Megatron's own fused Adam comes from Transformer Engine or apex; without both it uses torch's AdamW."""
    return _have("transformer_engine") or _have("apex")


def _megatron_wgrad_fusion() -> bool:
    """Megatron fuses the weight-gradient GEMM into the fp32 main grad only with apex's CUDA extension (or TE)."""
    return _have("fused_weight_gradient_mlp_cuda") or _have("transformer_engine")


MEGATRON = System(
    "megatron-core", "megatron-core",
    precision=lambda b: f"{b.compute} params; fp32 main grads (grad_reduce_in_fp32), fp32 main params and Adam "
                        "moments in the distributed optimizer",
    settings=lambda b: f"GPTModel, {'TE' if _have('transformer_engine') else 'local spec with torch SDPA attention'}"
                       f"{', SequentialMLP experts, allgather dispatcher' if b.a.experts else ''}, DDP overlap_grad_reduce + distributed "
                       f"optimizer ("
                       f"{'TE/apex FusedAdam' if _megatron_fused_optimizer() else 'torch AdamW, fused kernel'}), "
                       f"per-token loss, gradient_accumulation_fusion={_megatron_wgrad_fusion()}, unpacked rows "
                       "(packed documents need TE's THD attention)",
    unavailable=_megatron_unavailable,
    build=_build_megatron,
    packed=False,
)

SYSTEMS = [HFMEG, *TRANSFORMERS, TORCHTITAN, MEGATRON]
NAMES = [s.name for s in SYSTEMS]


def parse_args(argv=None, cuda: bool | None = None) -> argparse.Namespace:
    p = shape_parser("bench_peers", __doc__.split("\n")[0])
    p.add_argument("--repeats", type=at_least(1), default=3, help="rounds; each runs every system once")
    p.add_argument("--systems", default=",".join(NAMES), help=f"comma-separated, from {','.join(NAMES)}")
    a = resolve_args(p, p.parse_args(argv), cuda, GPU_DEFAULTS)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    unknown = [s for s in a.systems if s not in NAMES]
    if unknown or not a.systems:
        p.error(f"--systems: unknown {','.join(unknown) or '(none given)'}; choose from {','.join(NAMES)}")
    # bench_mfu's flags that the peers do not share: unpacked rows, no recompute
    a.trainer_path, a.recompute, a.hf_compile = False, "none", False
    return a


def _init_world_of_one(device: torch.device) -> None:
    """torchtitan's FSDP2 and Megatron-Core need a process group: a world of one, gloo on CPU, NCCL on CUDA."""
    if dist.is_initialized():
        return
    from hfmeg.parallel.launch import free_port
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1, device_id=device if device.type == "cuda" else None)


def _version(package: str | None) -> str | None:
    if package is None:
        return None
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    device = bench_device(a)
    dtype, shapes = settings(a, device)
    cfg = model_config_from_hf(hf_config(shapes))
    model = random_hf_model(hf_config(shapes), seed=a.seed, dtype=dtype, device="cpu")
    b = Bench(a, device, dtype, shapes, make_batches(a, device), TensorSource.snapshot(model))
    del model
    chosen = [s for s in SYSTEMS if s.name in a.systems]
    skipped = {s.name: s.unavailable(b) for s in chosen}
    for name, reason in skipped.items():
        if reason:
            print(f"skip {name}: {reason}", file=sys.stderr)
    running = [s for s in chosen if not skipped[s.name]]
    if any(s.package in ("torchtitan", "megatron-core") for s in running):
        _init_world_of_one(device)

    results: dict[str, list[SideResult]] = {s.name: [] for s in running}
    for r in range(a.repeats):
        for s in running[r % len(running):] + running[:r % len(running)]:
            results[s.name].append(s.run(b))
            _free(device)

    peak = peak_flops_of(a, device)
    timed_tokens = a.steps * a.grad_accum * a.micro_batch_size * a.seq
    rows = []
    for s in chosen:
        row = dict(system=s.name, version=_version(s.package), precision=s.precision(b), settings=s.settings(b),
                   skipped=skipped[s.name])
        if s.name in results:
            tps = [timed_tokens / res.seconds for res in results[s.name]]
            median = statistics.median(tps)
            mems = [res.peak_mem_bytes for res in results[s.name] if res.peak_mem_bytes is not None]
            row.update(repeats=len(tps), tokens_per_s=median, tokens_per_s_min=min(tps), tokens_per_s_max=max(tps),
                       tokens_per_s_all=tps, mfu=mfu(cfg, median, a.seq, peak, 1) if peak else None,
                       peak_mem_bytes=max(mems) if mems else None,
                       first_loss=results[s.name][0].losses[0], last_loss=results[s.name][0].losses[-1])
        rows.append(row)
    anchor = next((r["tokens_per_s"] for r in rows if r["system"] == "hfmeg" and not r["skipped"]), None)
    summary = dict(summary=True, device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   dtype=str(dtype).removeprefix("torch."), torch=torch.__version__, shapes=shapes,
                   repeats=a.repeats, tokens_per_step=a.grad_accum * a.micro_batch_size * a.seq,
                   flops_per_token=training_flops(cfg, 1, a.seq) / a.seq, flop_convention=FLOP_CONVENTION,
                   peak_flops=peak,
                   ratio_vs_hfmeg={r["system"]: (r["tokens_per_s"] / anchor if anchor and not r["skipped"] else None)
                                   for r in rows})
    _print_table(rows, summary)
    for row in rows + [summary]:
        print(json.dumps(row))
    return rows + [summary]


def _print_table(rows: list[dict], summary: dict) -> None:
    def gib(x):
        return f"{x / 2**30:.2f}" if x is not None else "-"

    print(f"{summary['device']}, {summary['dtype']}, shapes {summary['shapes']}, {summary['repeats']} rounds")
    print(f"{'system':<23}{'tokens/s median':>16}{'min..max':>22}{'MFU %':>7}{'peak GiB':>10}{'vs hfmeg':>9}")
    for r in rows:
        if r["skipped"]:
            print(f"{r['system']:<23}{'skipped':>16}")
            continue
        ratio = summary["ratio_vs_hfmeg"][r["system"]]
        spread = f"{r['tokens_per_s_min']:.1f}..{r['tokens_per_s_max']:.1f}"
        rate = f"{100 * r['mfu']:.1f}" if r["mfu"] is not None else "-"
        vs = f"{ratio:.3f}" if ratio is not None else "-"
        print(f"{r['system']:<23}{r['tokens_per_s']:>16.1f}{spread:>22}{rate:>7}{gib(r['peak_mem_bytes']):>10}{vs:>9}")


if __name__ == "__main__":
    run_main(main, "bench_peers", "try fewer --layers or --systems")
