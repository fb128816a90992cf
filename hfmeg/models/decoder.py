"""The Megatron-style decoder: one `ModelChunk` per pipeline stage (or virtual stage).

A chunk holds a contiguous range of decoder layers (named by their global index, so
names do not change with the layout), plus the token/position embeddings when it is
the first chunk and the final norm and LM head when it is the last. With PP=1 a
single chunk is the whole model.

Activations between layers are `[s, b, h]` (`[s/tp, b, h]` under sequence
parallelism). The first chunk takes token ids `[b, s]`; the last returns per-token
losses `[b, s]` when given labels, otherwise its vocab shard of the logits
`[b, s, padded_vocab/tp]`.

Labels are already aligned with inputs: `labels[:, t]` is the target for position
t (the data pipeline does the shift), and -100 marks tokens without loss.

Gemma 4's E2B and E4B: the first chunk also makes every layer's per-layer input (`models/per_layer_inputs.py`),
and a chunk that is not the last sends them on after its hidden state, `[s, b, hidden + layers * P]`
(`ModelConfig.stage_width`); a chunk's forward hands its layers one `kv_store` for the keys and values that later
layers reuse (KV sharing, `models/attention.py`), and a chunk that is not the last sends them on after those
(`models/shared_kv.py`): `ModelChunk.stage_width` is what the pipeline's buffers hold.

MoE models (`models/moe.py`) have the MoE block as the MLP of their sparse layers; Gemma 4's (`moe.beside_dense`)
runs beside the layer's dense MLP instead: the MLP reads the pre-MLP norm, the block the residual stream itself,
and the sum of their outputs, each normed (`dense_out_norm`, `moe_out_norm`), is what the MLP's output norm takes.
When the config asks for the router's load-balancing loss (`output_router_logits`), that
loss is a product of means over every MoE layer of the model (`models/load_balancing.py`):
each chunk adds its layers' router sums to those of the chunks before it
(`router_sums`), and a last chunk's forward with labels, given the sums of the chunks
before it (`received_sums`; none with PP = 1), leaves `router_aux_loss_coef` times HF's
loss for the pipeline to add (`take_aux_loss`).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import VOCAB_MULTIPLE, ModelConfig, check_cp, check_ep, check_tp
from ..data.microbatch import MicroBatch
from ..parallel.comm import scatter_to_sequence
from ..parallel.context import local_positions
from ..parallel.expert_dispatch import local_experts
from ..parallel.layers import VocabParallelEmbedding, VocabParallelHead, vocab_parallel_head
from ..parallel.linear_cross_entropy import CE_CHUNK_TOKENS
from ..parallel.params_ready import mark_compiled_block
from ..parallel.roles import ParamRole, add_param, set_role
from ..parallel.state import ParallelState
from .attention import ParallelAttention
from .document_attention import DocumentMask, MaskPlanner, flex_applies
from .gated_deltanet import GatedDeltaNet
from .kernels import Kernels
from .latent_attention import LatentAttention
from .mlp import ParallelMLP
from .load_balancing import add_router_sums, empty_router_sums, load_balancing_loss
from .moe import MoELayer
from .norm import make_norm
from .per_layer_inputs import PerLayerInput, PerLayerInputs
from .rope import RotaryEmbedding
from .shared_kv import SharedKV
from .staging import Stager, stage_microbatch

RECOMPUTE_MODES = ("none", "full", "selective")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, layer: int, kernels: Kernels):
        super().__init__()
        sp = ps.sequence_parallel
        # OLMo 2 (`pre_norms` False): no norm before the attention and the MLP, only the output norms.
        pre = (lambda: make_norm(cfg, sp, kernels)) if cfg.pre_norms else nn.Identity
        self.input_norm = pre()
        # Qwen3.5's linear-attention layers take the attention's place (and its arguments); DeepSeek's MLA is its
        # attention.
        if cfg.is_linear(layer):
            self.attn = GatedDeltaNet(cfg, ps)
        else:
            self.attn = (LatentAttention if cfg.mla is not None else ParallelAttention)(cfg, ps, layer, kernels)
        self.post_attn_norm = pre()  # before the MLP (HF's LLaMA name kept)
        beside = cfg.is_sparse(layer) and cfg.moe.beside_dense
        dense = not cfg.is_sparse(layer) or beside
        self.mlp = ParallelMLP(cfg, ps, kernels, cfg.ffn_size_of(layer)) if dense else MoELayer(cfg, ps, kernels)
        self.moe = MoELayer(cfg, ps, kernels) if beside else None
        if beside:
            self.dense_out_norm = make_norm(cfg, sp, kernels)
            self.moe_out_norm = make_norm(cfg, sp, kernels)
        self.sandwich = cfg.sandwich_norms
        if cfg.layer_scalar:  # Gemma 4: the layer's output times a value it loads and never trains (a buffer in HF)
            add_param(self, "layer_scalar", 1, role=ParamRole("bias"))
            self.layer_scalar.requires_grad_(False)
        else:
            self.layer_scalar = None
        if self.sandwich:  # Gemma: the attention's and the MLP's outputs are normed before the residual add
            self.attn_out_norm = make_norm(cfg, sp, kernels)
            self.mlp_out_norm = make_norm(cfg, sp, kernels)
        # Gemma 4 E2B/E4B: the layer's per-layer input joins the residual stream (`models/per_layer_inputs.py`)
        self.per_layer = PerLayerInput(cfg, sp, kernels) if cfg.per_layer_input_size else None

    def forward(self, x, rope, docs, selective: bool = False, per_layer: torch.Tensor | None = None,
                kv_store: dict | None = None):
        """`per_layer`: this layer's per-layer input; `kv_store`: the shared keys and values (KV sharing)."""
        shared = {} if kv_store is None else {"kv_store": kv_store}  # only ParallelAttention shares K/V
        a = self.attn(self.input_norm(x), rope, docs, recompute_core=selective, **shared)
        x = x + (self.attn_out_norm(a) if self.sandwich else a)
        m = self.mlp(self.post_attn_norm(x))
        if self.moe is not None:
            m = self.dense_out_norm(m) + self.moe_out_norm(self.moe(x))
        x = x + (self.mlp_out_norm(m) if self.sandwich else m)
        if self.per_layer is not None:
            x = self.per_layer(x, per_layer)
        return x if self.layer_scalar is None else x * self.layer_scalar

    @property
    def moe_block(self) -> MoELayer | None:
        """This layer's MoE block, None on a dense layer."""
        return self.moe if self.moe is not None else (self.mlp if isinstance(self.mlp, MoELayer) else None)


class ModelChunk(nn.Module):
    """Layers `layers` of the model on this rank, with the ends it owns."""

    def __init__(
        self,
        cfg: ModelConfig,
        ps: ParallelState,
        layers: Iterable[int],
        *,
        pre_process: bool,
        post_process: bool,
        vocab_multiple: int = VOCAB_MULTIPLE,
        recompute: str = "none",
        ce_chunk_tokens: int = CE_CHUNK_TOKENS,
        compile_backend: str | None = None,
    ):
        super().__init__()
        check_tp(cfg, ps.tp)
        check_ep(cfg, ps.ep)
        check_cp(cfg, ps.cp)
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
        self.cfg, self.ps = cfg, ps
        self.pre_process, self.post_process = pre_process, post_process
        self.recompute = recompute
        self.ce_chunk_tokens = ce_chunk_tokens
        self.vocab_multiple = vocab_multiple  # read back when the chunk is saved (checkpoint/mp_save.py)
        self.padded_vocab = cfg.padded_vocab(ps.tp, vocab_multiple)
        self.layer_ids = list(layers)
        # The global indices of the routed experts this rank holds in each MoE layer (None: a dense model).
        self.experts = local_experts(cfg.moe.num_experts, ps.ep, ps.ep_rank) if cfg.moe is not None else None
        self.shared_kv = SharedKV(cfg, ps) if cfg.kv_source else None  # sent between stages with the activations
        if pre_process:
            self.embed = VocabParallelEmbedding(self.padded_vocab, cfg.hidden_size, ps, tied=cfg.tie_embeddings,
                                                padding_idx=cfg.pad_token_id)
            if cfg.positions == "learned":
                self.pos_embed = nn.Embedding(cfg.max_positions, cfg.hidden_size)
                # Replicated; not sequence-parallel: `_embed` scatters its output, so each rank's gradient is full.
                set_role(self.pos_embed, "weight", ParamRole("embedding"))
        # The RoPE tables by `ModelConfig.rope_key` (one set, under None, but for Gemma 3's per layer type).
        # Each key's rotated dims are those of its layers' heads (`rotary_dim_of`: one size per key).
        keys = {cfg.rope_key(i): cfg.rotary_dim_of(i) for i in range(cfg.num_layers)} if cfg.positions == "rope" else {}
        self.ropes = {key: RotaryEmbedding(cfg, key, dim) for key, dim in keys.items()}
        self.rope = self.ropes.get(None)
        kernels = Kernels(compile_backend)  # norm/RoPE/SwiGLU: eager, or fused by torch.compile
        if pre_process and cfg.per_layer_input_size:  # Gemma 4 E2B/E4B: every layer's input, made here
            self.per_layer_inputs = PerLayerInputs(cfg, ps, self.padded_vocab, kernels)
        self.layers = nn.ModuleDict()
        for i in self.layer_ids:
            # With a compile backend a dense layer's forward is one graph (norms, projections, RoPE, attention,
            # MLP, residual adds, and in its backward the fused weight-gradient writes); its parameter waits stay
            # outside, before it (params_ready.py): the forward, not the module, is compiled, so the module's
            # hooks run eagerly around the graph. MoE layers keep the compiled kernels alone: their routed row
            # counts change from micro-batch to micro-batch under EP, and torch 2.13 traces grouped GEMMs in bf16 only.
            whole = compile_backend is not None and not cfg.is_sparse(i)
            layer = self.layers[str(i)] = DecoderLayer(cfg, ps, i, Kernels(None) if whole else kernels)
            if whole:
                layer.forward = torch.compile(layer.forward, backend=compile_backend)
                mark_compiled_block(layer)
        self.aux_loss: torch.Tensor | None = None  # see take_aux_loss
        # The head's logits are divided by this before their loss (GRPO at a sampling temperature other than 1:
        # its log-probabilities are those of softmax(logits / T), as TRL's are; set by train/grpo.py).
        self.logit_temperature = 1.0
        if post_process:
            self.final_norm = make_norm(cfg, ps.sequence_parallel, kernels)
            if not (cfg.tie_embeddings and pre_process):
                # With tied embeddings: the last stage's copy of the first stage's `embed.weight`.
                self.lm_head = VocabParallelHead(cfg.hidden_size, self.padded_vocab, cfg.vocab_size, ps,
                                                 tied_copy=cfg.tie_embeddings, softcap=cfg.final_softcap)

    def forward(
        self,
        x: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        row_segment_ids: torch.Tensor | None = None,
        docs: DocumentMask | None = None,
        labels: torch.Tensor | None = None,
        seq_len: int | None = None,
        received_sums: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the chunk.

        `x` is token ids `[b, s]` on the first chunk, hidden states otherwise.
        `position_ids` / `segment_ids` `[b, s]` describe packed documents (defaults:
        0..s-1, one document); `docs`, the mask `stage` built ahead from `segment_ids`,
        stands for them. Under context parallelism every `[b, s]` input holds this CP
        rank's tokens only (`MicroBatch.shard`), `s` the local count, and
        `row_segment_ids` `[b, s * cp]` the whole rows' document ids. Later
        chunks need `seq_len` under SP only when they receive no ids to read it from; it
        defaults from the inputs. `received_sums`: the
        router sums of the chunks before this one (see the module doc), read by a last
        chunk given labels.
        """
        ps = self.ps
        if self.pre_process:
            b, s = x.shape
        else:
            s = seq_len or (x.shape[0] * (ps.tp if ps.sequence_parallel else 1))
            b = x.shape[1]
        if position_ids is None:
            position_ids = local_positions(b, s, ps, x.device)
        cfg, carried = self.cfg, None  # carried: every layer's per-layer input (Gemma 4 E2B/E4B), else None
        kv_store = {} if cfg.kv_source else None  # KV sharing: the producing layers' keys and values
        if self.pre_process:
            ids, x = x, self._embed(x, position_ids)
            carried = self.per_layer_inputs(ids, x) if cfg.per_layer_input_size else None
        elif self.stage_width > cfg.hidden_size:  # they travel with the hidden state (`stage_width`)
            per_layer = cfg.num_layers * cfg.per_layer_input_size
            x, carried, shared = x.split([cfg.hidden_size, per_layer, self.stage_width - cfg.stage_width], dim=-1)
            carried = carried if per_layer else None
            if self.shared_kv is not None:  # the keys and values earlier stages made
                self.shared_kv.unpack(shared, kv_store, before=min(int(i) for i in self.layers))
        # One unbind, not a slice per layer: its backward stacks the layers' gradients once.
        inputs = carried.unflatten(-1, (cfg.num_layers, -1)).unbind(-2) if carried is not None else None
        dtype = self._compute_dtype()
        tables = {key: rope(position_ids, dtype) for key, rope in self.ropes.items()}
        if docs is None:
            docs = self.mask_planner(x.device).mask(segment_ids, s, row_segment_ids)
        for i, layer in self.layers.items():
            rope = tables.get(cfg.rope_key(int(i)))
            extra = {"per_layer": inputs[int(i)] if inputs is not None else None, "kv_store": kv_store}
            if self.recompute == "full" and torch.is_grad_enabled():
                x = checkpoint(layer, x, rope, docs, use_reentrant=False, **extra)
            else:
                x = layer(x, rope, docs, selective=self.recompute == "selective" and torch.is_grad_enabled(), **extra)
        if not self.post_process:
            sent = [x] + ([carried] if carried is not None else [])
            sent += [self.shared_kv.pack(kv_store, x)] if self.shared_kv is not None else []
            return x if len(sent) == 1 else torch.cat(sent, dim=-1)
        if labels is not None and self.cfg.adds_aux_loss:
            moe = self.cfg.moe
            sums = self.router_sums(received_sums)
            self.aux_loss = moe.router_aux_loss_coef * load_balancing_loss(sums, moe.num_experts, self.ps)
        return self._head(x, labels)

    @property
    def stage_width(self) -> int:
        """The features a chunk sends the next per token: `ModelConfig.stage_width`'s, then the shared keys and
        values (`models/shared_kv.py`)."""
        return self.cfg.stage_width + (self.shared_kv.width if self.shared_kv is not None else 0)

    def mask_planner(self, device: torch.device | None = None) -> MaskPlanner:
        """How this rank attends packed rows on `device` (default: the rank's): flex_attention or a dense mask,
        its CP split (document_attention.py)."""
        ps = self.ps
        device = device or ps.device
        return MaskPlanner(device, ps.cp, ps.cp_rank, flex_applies(device, self.cfg.head_dim), self._compute_dtype(),
                           self.cfg.sliding_window,
                           explicit=self.cfg.attn_softcap is not None or self.cfg.attn_sinks,
                           recurrent=self.cfg.linear_attention is not None)

    def stage(self, mb: MicroBatch) -> MicroBatch:
        """A micro-batch on this rank's device with its attention decided (models/staging.py)."""
        return stage_microbatch(mb, self.mask_planner())

    def stager(self) -> Stager:
        """What stages this rank's batches in the data prefetch thread (models/staging.py)."""
        return Stager(self.mask_planner())

    def router_sums(self, received: torch.Tensor | None) -> torch.Tensor:
        """The router sums of the last forward through this chunk and the chunks before it
        (`received`: theirs, None on the first chunk), differentiable in this chunk's routing."""
        stats = [layer.moe_block.stats for layer in self.layers.values() if layer.moe_block is not None]
        return add_router_sums(received, stats, self.cfg.moe.num_experts, self.ps.device)

    def empty_router_sums(self) -> torch.Tensor:
        """A buffer for the router sums a neighbouring chunk sends."""
        return empty_router_sums(self.cfg.moe.num_experts, self.ps.device)

    def take_aux_loss(self) -> torch.Tensor | None:
        """`router_aux_loss_coef` x the load-balancing loss of the last forward with labels (then
        forgotten), or None when the model adds none. The same value on every TP rank, like the loss."""
        aux, self.aux_loss = self.aux_loss, None
        return aux

    def _compute_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def _embed(self, ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # [s, b, h], already sequence-scattered under SP
        if self.cfg.embed_scale:  # Gemma: sqrt(hidden) rounded to the embedding's dtype, as transformers does
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)
        if self.cfg.positions == "learned":
            pos = self.pos_embed(position_ids).transpose(0, 1)
            # Scatter (not slice) so each rank's position-embedding gradient is the full one.
            x = x + (scatter_to_sequence(pos, self.ps) if self.ps.sequence_parallel else pos)
        return x

    def _head(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        x = self.final_norm(x)
        if self.logit_temperature != 1.0:  # (x / T) W = (x W) / T: the head has no soft-cap here (set_temperature)
            x = x / self.logit_temperature
        if hasattr(self, "lm_head"):
            return self.lm_head(x, labels, self.ce_chunk_tokens)
        # Tied embeddings with both ends here: the embedding's weight is the head.
        return vocab_parallel_head(x, self.embed.weight, labels, self.ps, self.cfg.vocab_size, self.ce_chunk_tokens,
                                   self.cfg.final_softcap)
