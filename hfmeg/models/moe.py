"""Mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek-V3).

Routing, as transformers computes it for these families:
1. router logits = x W_r^T (+ b_r: gpt-oss) in the compute dtype (`W_r` `[experts, hidden]`);
2. probabilities = softmax over experts in fp32; the top-k of them pick each token's experts;
3. the k weights are renormalised to sum to 1 when the model says so (Mixtral always,
   Qwen when `norm_topk_prob`); Qwen then casts them to the compute dtype, Mixtral
   keeps them in fp32 until each weighted expert output is cast back
   (`MoEConfig.combine_fp32`); gpt-oss's softmax over the k chosen logits is this renormalisation;
4. each expert is a SwiGLU MLP, `fc2(silu(gate) * up)` with `fc1 = [gate; up]`; a token's
   output is the sum of its k experts' outputs times their weights, accumulated in
   ascending expert order into zeros, exactly as HF's `index_add_` loop does; gpt-oss's experts have biases
   and a clamped SwiGLU (`MoEConfig.expert_bias`, `swiglu_limit`; kernels.clamped_swiglu);
5. Qwen2-MoE adds a shared expert every token goes through, scaled by
   `sigmoid(shared_expert_gate(x))`; DeepSeek-V3 adds its shared experts (one SwiGLU MLP) ungated.

Gemma 4's block (`MoEConfig.router_scales`, `beside_dense`): the router reads the residual stream x RMS-normalised
with no weight, times a learned per-channel `router_scale` and hidden^-0.5; its renormalised top-k weights (fp32)
are times each chosen expert's learned `per_expert_scale`; the experts are GeGLU (the model's activation) and read
their own norm of x (`expert_norm`, HF's `pre_feedforward_layernorm_2`). The dense MLP beside them is the decoder
layer's (`models/decoder.py`).

DeepSeek-V3 routes by sigmoid scores over expert groups with a correction bias instead of steps 2-3
(`models/routing.py`), its weights in fp32 as Mixtral's.

Dispatch (`parallel/expert_dispatch.py`): the (token, slot) pairs are sorted by expert
once (a stable argsort), so each expert's tokens are one contiguous block; the per-expert
counts and their running ends (the group offsets) are computed on the device.

Grouped experts (`GroupedExperts`): this rank's routed experts are two stacked weights,
`fc1` `[E_local, 2F, H]` (each expert's [gate; up], the rows of HF's gate then up) and
`fc2` `[E_local, H, F]`. All routed rows go through `fc1` as one grouped GEMM
(`models/grouped_linear.py`: group g is expert g's block), SwiGLU runs once over all of
them (one shape per call), and `fc2` is a second grouped GEMM; the backward is grouped
GEMMs too. Nothing reads the counts on the host, so at EP = 1 a MoE layer's forward and
backward never wait for the device (where the GEMMs' sizes fit the kernel, see there).
An expert no token chose is an empty group: its weight gradient is zero, and since all
experts are one parameter, every rank's backward fills the same parameters in the same
order for the data-parallel wrapper's per-bucket hooks. On disk each expert is still a
tensor of its own under its global index (`parallel/stored_names.py`), the names shard
files had before the experts were stacked, so those files still load.

Expert parallelism (EP): EP rank j builds only its `E / ep` experts, the contiguous block
`expert_dispatch.local_experts`, stored under their global indices so checkpoint names do
not depend on the layout. Each rank routes its own tokens, the
dispatcher sends every routed copy to the rank holding its expert (all-to-all over the
EP group) and brings the outputs back in the same expert-sorted order as at EP = 1;
weighting and the per-token sum are then the same code, so EP = 1 is the plain sort
and each token's k outputs are added in the same order at every EP size. The EP group
is made of DP neighbours (`parallel/state.py`): the tokens are different data, and an
expert's gradient collects every EP rank's tokens; the expert-data-parallel group sums
the rest (`parallel/data_parallel.py`).

Tensor parallelism: experts are NOT split over TP. Inside the MoE layer each TP rank
handles its own share of the tokens: under SP the sequence shard it already holds;
without SP it takes its block of the replicated tokens (`comm.split_tokens`) and the
outputs are all-gathered back (`comm.gather_tokens`). So the router, the experts and
the shared expert are TP-replicated parameters whose gradient on each TP rank comes
from that rank's tokens only: their role says `sequence_parallel` (summed over TP once
per step, with or without SP), and the routed experts' role says `expert`, for expert
parallelism to find them. TP thus divides the MoE work instead of repeating it, and no
expert matrix needs a TP collective.

The routing of the last forward stays in each layer's `stats` (`RouterStats`): HF's
load-balancing loss over all MoE layers is built from them (`models/load_balancing.py`),
and the tokens-per-expert log reads them (`expert_load`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..config import ModelConfig, MoEConfig
from ..parallel.comm import gather_tokens, split_tokens
from ..parallel.expert_dispatch import Dispatched, TokenDispatcher, local_experts
from ..parallel.layers import ReplicatedLinear
from ..parallel.roles import ParamRole, add_param
from ..parallel.state import ParallelState
from ..parallel.stored_names import set_stored_names
from .grouped_linear import grouped_linear
from .kernels import Kernels
from .norm import RMSNorm
from .routing import ScoreBias, sigmoid_grouped_topk

# Replicated, used on this rank's tokens only: partial gradients, summed over TP.
_PARTIAL = ParamRole("weight", sequence_parallel=True)
_EXPERT = ParamRole("weight", sequence_parallel=True, expert=True)
_EXPERT_BIAS = ParamRole("bias", sequence_parallel=True, expert=True)
_SCALE = ParamRole("norm", sequence_parallel=True)  # Gemma 4's router scales: no weight decay, as a norm's


@dataclass
class RouterStats:
    """One MoE layer's routing of this rank's tokens in its last forward."""

    tokens_per_expert: torch.Tensor  # [experts] int64: top-k slots routed to each expert (the load)
    prob_sum: torch.Tensor  # [experts] fp32, differentiable: router probabilities summed over the tokens
    rows: int  # tokens routed


class GatedExpert(nn.Module):
    """A SwiGLU MLP held whole (not TP-split): `fc1` `[2F, H]` = [gate; up], `fc2` `[H, F]` (Qwen2-MoE's
    shared expert, which every token goes through)."""

    def __init__(self, hidden: int, ffn: int, role: ParamRole, kernels: Kernels):
        super().__init__()
        self.kernels = kernels
        self.fc1 = ReplicatedLinear(hidden, 2 * ffn, role)
        self.fc2 = ReplicatedLinear(ffn, hidden, role)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(self.kernels.swiglu(gate, up))


class GroupedExperts(nn.Module):
    """This rank's routed experts `experts` (global indices), stacked: `fc1` `[E_local, 2F, H]` (each expert's
    [gate; up]) and `fc2` `[E_local, H, F]`, stored per expert as `{e}.fc1.weight` and `{e}.fc2.weight`; with
    `moe.expert_bias` (gpt-oss) their biases `fc1_bias` `[E_local, 2F]` and `fc2_bias` `[E_local, H]`, stored as
    `{e}.fc1.bias` and `{e}.fc2.bias`, each row given its expert's by repeating expert g's `offsets` block."""

    def __init__(self, experts: range, hidden: int, ffn: int, kernels: Kernels, moe: MoEConfig, gelu: bool = False):
        super().__init__()
        self.kernels, self.moe = kernels, moe
        self.glu = kernels.geglu if gelu else kernels.swiglu  # Gemma 4's experts are GeGLU
        add_param(self, "fc1", len(experts), 2 * ffn, hidden, role=_EXPERT)
        add_param(self, "fc2", len(experts), hidden, ffn, role=_EXPERT)
        for name in ("fc1", "fc2"):
            set_stored_names(self, name, [f"{e}.{name}.weight" for e in experts])
        if moe.expert_bias:
            add_param(self, "fc1_bias", len(experts), 2 * ffn, role=_EXPERT_BIAS)
            add_param(self, "fc2_bias", len(experts), hidden, role=_EXPERT_BIAS)
            for name in ("fc1", "fc2"):
                set_stored_names(self, f"{name}_bias", [f"{e}.{name}.bias" for e in experts])
        # LoRA on each stacked weight (`hfmeg/peft/adapters.py` ExpertLora): `(rows, offsets)` -> its update.
        self.fc1_lora: nn.Module | None = None
        self.fc2_lora: nn.Module | None = None
        self.fp8 = None  # `model.fp8`: both GEMMs' `Fp8Gemms` (`models/fp8.py`, `grouped_linear.py`)
        # QLoRA: each stack's 4-bit weight provider (`quant/qlora.py`), set by `checkpoint/load.py` in place of the
        # dropped parameter; the GEMM then takes the stack from it.
        self.fc1_provider: nn.Module | None = None
        self.fc2_provider: nn.Module | None = None

    def _gemm(self, x: torch.Tensor, name: str, offsets: torch.Tensor) -> torch.Tensor:
        """`x` times the stack `name` (fc1 / fc2), from its parameter or its provider."""
        provider = getattr(self, f"{name}_provider")
        if provider is None:
            return grouped_linear(x, getattr(self, name), offsets, self.fp8)
        return grouped_linear(x, provider(), offsets, provider=provider)

    def forward(self, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Rows `[R, h]` sorted by expert, expert g's block ending at `offsets[g]`: their outputs `[R, h]`."""
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long() if self.moe.expert_bias else None
        h = self._gemm(rows, "fc1", offsets)
        if self.fc1_lora is not None:
            h = h + self.fc1_lora(rows, offsets)
        if counts is not None:
            h = h + self.fc1_bias.repeat_interleave(counts, dim=0, output_size=rows.shape[0])
        gate, up = h.chunk(2, dim=-1)
        m = self.moe
        if m.swiglu_limit is not None:
            act = self.kernels.clamped_swiglu(gate, up, m.swiglu_alpha, m.swiglu_limit)
        else:
            act = self.glu(gate, up)
        out = self._gemm(act, "fc2", offsets)
        out = out if self.fc2_lora is None else out + self.fc2_lora(act, offsets)
        if counts is not None:
            out = out + self.fc2_bias.repeat_interleave(counts, dim=0, output_size=rows.shape[0])
        return out


class MoELayer(nn.Module):
    """The MoE block of one decoder layer: `[s, b, h]` (`[s/tp, b, h]` under SP) in and out.

    `stats` holds the routing of the last forward (`RouterStats`): the load-balancing
    loss reads it, and so does the log of tokens per expert.
    """

    def __init__(self, cfg: ModelConfig, ps: ParallelState, kernels: Kernels):
        super().__init__()
        m = cfg.moe
        self.ps, self.moe = ps, m
        h = cfg.hidden_size
        self.router = ReplicatedLinear(h, m.num_experts, _PARTIAL, bias=m.router_bias)
        self.dispatcher = TokenDispatcher(m.num_experts, ps.ep, ps.ep_group)
        self.experts = GroupedExperts(local_experts(m.num_experts, ps.ep, ps.ep_rank), h, m.expert_ffn_size, kernels,
                                      m, gelu=cfg.activation == "gelu_tanh")
        self.kernels, self.eps, self.root = kernels, cfg.norm_eps, h ** -0.5
        if m.router_scales:  # Gemma 4 (module doc); ones, as transformers initialises them
            add_param(self, "router_scale", h, role=_SCALE)
            add_param(self, "per_expert_scale", m.num_experts, role=_SCALE)
        if m.beside_dense:  # the experts' own input norm (a rank's tokens only: partial gradient, summed over TP)
            self.expert_norm = RMSNorm(h, cfg, True, kernels)
        if m.score_correction_bias:
            self.score_bias = ScoreBias(m.num_experts)
        if m.shared_expert_ffn_size:
            self.shared = GatedExpert(h, m.shared_expert_ffn_size, _PARTIAL, kernels)
        if m.shared_expert_ffn_size and m.shared_expert_gate:
            self.shared_gate = ReplicatedLinear(h, 1, _PARTIAL)
        self.stats: RouterStats | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        if self.ps.sequence_parallel:
            return self._tokens(tokens).view(s, b, h)
        return gather_tokens(self._tokens(split_tokens(tokens, self.ps)), self.ps, s * b).view(s, b, h)

    def _tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The MoE output of this rank's tokens `x` `[n, h]`."""
        m = self.moe
        if m.router_scales:
            logits = self.router(self.kernels.rms_norm_fp32(x, None, self.eps) * self.router_scale * self.root)
        else:
            logits = self.router(x)
        if m.scoring == "sigmoid":
            bias = self.score_bias.bias if m.score_correction_bias else None
            weights, chosen, probs = sigmoid_grouped_topk(logits, bias, m)
        else:
            probs = torch.softmax(logits.float(), dim=-1)
            weights, chosen = probs.topk(m.top_k, dim=-1)  # [n, k]
            if m.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if m.router_scales:
                weights = weights * self.per_expert_scale[chosen]
        if not m.combine_fp32:
            weights = weights.to(logits.dtype)
        prob_sum = probs.sum(dim=0)
        routed = self.expert_norm(x) if m.beside_dense else x
        d = self.dispatcher.dispatch(routed, chosen)  # (token, slot) pairs grouped by expert, sent to their ranks
        self.stats = RouterStats(d.counts, prob_sum, x.shape[0])
        if m.score_correction_bias and self.router.weight.requires_grad:
            self.score_bias.count(d.counts)
        out = self._experts(x, d, weights)
        if hasattr(self, "shared_gate"):
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        elif hasattr(self, "shared"):  # DeepSeek's shared experts: ungated
            out = out + self.shared(x)
        return out

    def _experts(self, x: torch.Tensor, d: Dispatched, weights: torch.Tensor) -> torch.Tensor:
        y = self.dispatcher.combine(self.experts(d.rows, d.offsets), d) * weights.reshape(-1)[d.order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, d.token, y.to(x.dtype))


def expert_load(chunks: list[nn.Module], ps: ParallelState) -> dict[int, list[int]]:
    """{layer: [min, max]} tokens routed to one expert, per MoE layer of the model, in the last forward.

    Collective over the world: each rank adds the routing of its own tokens (its TP share,
    its DP rank's batch) for the layers it holds, so the sums are the global load of the
    step's last micro-batch. Routing collapse shows as a min near 0 and a max near
    top_k x tokens."""
    cfg = chunks[0].cfg
    layers = cfg.moe.sparse_layers
    counts = torch.zeros(len(layers), cfg.moe.num_experts, dtype=torch.int64, device=ps.device)
    for chunk in chunks:
        for i, layer in chunk.layers.items():
            block = layer.moe_block
            if block is not None and block.stats is not None:
                counts[layers.index(int(i))] += block.stats.tokens_per_expert
    if ps.world_size > 1:
        dist.all_reduce(counts)
    return {i: [int(c.min()), int(c.max())] for i, c in zip(layers, counts.cpu())}
