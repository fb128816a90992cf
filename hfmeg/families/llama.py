"""LLaMA, and the decoder every LLaMA-layout family shares (Mistral, Qwen2, the MoE families).

`decoder_config` reads what all of them read; a family passes what differs (biases, its
sliding-window rule, QK-norm, its MoE reader). `layer_rules` is the LLaMA weight layout:
`model.layers.{i}.self_attn.{q,k,v,o}_proj`, `mlp.{gate,up,down}_proj`, the two RMSNorms, and
an MoE layer's router and experts, per expert as `save_pretrained` writes them (named by
the family's `ExpertNames`) or stacked as transformers holds them in memory.
"""

from __future__ import annotations

from typing import Callable, Collection

from transformers import PretrainedConfig

from ..config import SUPPORTED_ROPE_TYPES, ModelConfig, MoEConfig, require, rope_check
from .spec import ExpertNames, FamilySpec, PeftNames, TensorRule

# What `all-linear` stands for in a LLaMA-layout decoder layer (peft excludes the output layer).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = PROJECTIONS[:4]
MLP = ExpertNames("mlp.", "gate_proj", "up_proj", "down_proj")  # a dense MLP's, and Qwen's experts' names


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def stacked_expert_names(i: int) -> tuple[str, str]:
    """Layer i's stacked expert tensors, as transformers holds them: gate_up `[E, 2F, H]`, down `[E, H, F]`."""
    return f"{layer_prefix(i)}mlp.experts.gate_up_proj", f"{layer_prefix(i)}mlp.experts.down_proj"


Window = tuple[int | None, tuple[int, ...]]  # the sliding window, and the layers that attend in full despite it


def no_window(hf: PretrainedConfig) -> Window:
    """The Qwen MoE families' sliding window (`use_sliding_window`) is refused: not built for them."""
    require(not getattr(hf, "use_sliding_window", False), "use_sliding_window",
            f"{hf.model_type} sliding-window attention is not supported")
    return None, ()


def every_layer_window(hf: PretrainedConfig) -> Window:
    """Mistral's rule: `sliding_window` (None: none) on every layer."""
    return getattr(hf, "sliding_window", None), ()


def layer_types_window(hf: PretrainedConfig) -> Window:
    """`sliding_window` on the layers `layer_types` calls sliding_attention (none when the window is None);
    a layer type hfmeg does not build is refused."""
    window = getattr(hf, "sliding_window", None)
    types = list(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    known = {"full_attention", "sliding_attention"}
    require(set(types) <= known, "layer_types", f"{sorted(set(types) - known)} are not supported (supported: "
            f"{', '.join(sorted(known))})")
    require(len(types) == hf.num_hidden_layers, "layer_types",
            f"{len(types)} entries for num_hidden_layers={hf.num_hidden_layers}")
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    if window is None or len(full) == len(types):
        return None, ()
    return window, full


LAYER_TYPES = ("sliding_attention", "full_attention")


def rope_per_layer_type(hf: PretrainedConfig, also: tuple[str, ...] = ()) -> None:
    """Refuses `rope_parameters` that are not one built RoPE per layer type (Gemma 3, OLMo 3), or a null window
    (`ModelConfig.rope_key` picks a layer's RoPE by its window). `also`: RoPE types the family builds besides
    (Gemma 4's `proportional`, whose `partial_rotary_factor` zeroes frequencies rather than narrowing the table)."""
    params = getattr(hf, "rope_parameters", None) or {}
    require(set(params) == set(LAYER_TYPES), "rope_parameters", f"one entry per layer type ({', '.join(LAYER_TYPES)}) "
            f"expected, got {sorted(params)}")
    built = tuple(t for t in SUPPORTED_ROPE_TYPES if t != "longrope") + also  # LongRoPE per layer type: not built
    for layer_type in LAYER_TYPES:
        p = params[layer_type]
        rope_type = p.get("rope_type", "default")
        require(rope_type in built, f"rope_parameters.{layer_type}.rope_type",
                f"{rope_type!r} is not supported for {hf.model_type} (supported: {', '.join(built)})")
        require(rope_type in also or p.get("partial_rotary_factor", 1.0) == 1.0,
                f"rope_parameters.{layer_type}.partial_rotary_factor",
                f"partial rotary embeddings are not supported for {hf.model_type}")
    require(getattr(hf, "sliding_window", None) is not None, "sliding_window",
            f"null: {hf.model_type}'s sliding layers need a window")


def padding_row(hf: PretrainedConfig) -> int | None:
    """The embedding row transformers builds its `nn.Embedding` with as `padding_idx` (`pad_token_id`; a
    negative id counts from the end, as torch counts it)."""
    pad, vocab = getattr(hf, "pad_token_id", None), hf.vocab_size
    if pad is None:
        return None
    require(-vocab <= pad < vocab, "pad_token_id", f"{pad} is not a row of the vocabulary of {vocab}")
    return pad % vocab


# The MLP activations hfmeg builds: the HF name (`ACT2FN`'s key) -> ModelConfig.activation.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def decoder_config(hf: PretrainedConfig, *, qkv_bias: bool | None = None, out_bias: bool | None = None,
                   window: Callable[[PretrainedConfig], Window] = lambda hf: (None, ()), qk_norm: bool = False,
                   moe: Callable[[PretrainedConfig], MoEConfig] | None = None,
                   partial_rotary: bool = False, act_field: str = "hidden_act") -> ModelConfig:
    """A LLaMA-layout config; a bias left None follows `attention_bias`, `window` returns the sliding window
    and the layers without it (or refuses a window), `moe` reads the MoE fields, `partial_rotary` lets `partial_rotary_factor` be
    below 1, `act_field` names the field the family's transformers MLP reads its activation from (Gemma's
    `hidden_activation`: its published configs carry a `hidden_act` too, which transformers keeps and never reads).

    Fields transformers keeps but does not compute with are not read, so never refused: `pretraining_tp` (LLaMA 2,
    SmolLM3 publish 2; transformers 5's forward ignores it, and 4.x's split matmuls summed the same products) stays
    in the HF config and is exported verbatim."""
    rotary = rope_check(hf, partial=partial_rotary)
    t = hf.model_type
    act = getattr(hf, act_field, "silu")
    require(act in ACTIVATIONS, act_field, f"{act!r} is not supported for {t} (supported: {', '.join(ACTIVATIONS)})")
    heads = hf.num_attention_heads
    kv = getattr(hf, "num_key_value_heads", None) or heads
    require(heads % kv == 0, "num_key_value_heads", f"{kv} does not divide num_attention_heads={heads}")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    sliding, full_layers = window(hf)
    require(sliding is None or sliding >= 1, "sliding_window", f"{sliding} is not a window (use 1 or more)")
    attention_bias = bool(getattr(hf, "attention_bias", False))
    return ModelConfig(
        model_type=t,
        hidden_size=hf.hidden_size,
        ffn_size=getattr(hf, "intermediate_size", 0),  # Qwen3.5-MoE has none: every layer is sparse
        num_layers=hf.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        vocab_size=hf.vocab_size,
        max_positions=hf.max_position_embeddings,
        norm="rms",
        norm_eps=hf.rms_norm_eps,
        activation=ACTIVATIONS[act],
        gated_mlp=True,
        positions="rope",
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        out_bias=attention_bias if out_bias is None else out_bias,
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        tie_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        sliding_window=sliding,
        full_attention_layers=full_layers,
        bos_token_id=getattr(hf, "bos_token_id", None),
        pad_token_id=padding_row(hf),
        qk_norm=qk_norm,
        partial_rotary_factor=rotary,
        moe=moe(hf) if moe is not None else None,
        hf_config=hf,
    )


def _expert_rules(local: str, hf: str, names: tuple[str, str, str], hidden: int, ffn: int) -> list[TensorRule]:
    """One SwiGLU expert: `local.fc1` = [gate; up] from HF `hf + names[0|1]`, `local.fc2` = `hf + names[2]`."""
    gate, up, down = (f"{hf}{n}.weight" for n in names)
    return [TensorRule(local + "fc1.weight", (gate, up), "fused", shapes=((ffn, hidden), (ffn, hidden))),
            TensorRule(local + "fc2.weight", (down,), "replicated", shapes=((hidden, ffn),))]


def _moe_rules(cfg: ModelConfig, i: int, experts: Collection[int], on_disk: ExpertNames) -> list[TensorRule]:
    m, h = cfg.moe, cfg.hidden_size
    L = f"layers.{i}.mlp."
    names = MLP if m.fused_experts else on_disk  # stacked experts: every family's in-memory names
    p = layer_prefix(i) + names.block
    rules = [TensorRule(L + "router.weight", (p + "gate.weight",), "replicated", shapes=((m.num_experts, h),))]
    if m.fused_experts:
        E, f = m.num_experts, m.expert_ffn_size
        gate_up, down = stacked_expert_names(i)
        # All fc1 slices, then all fc2 slices: each stacked tensor is read once (rule_tensors).
        rules += [TensorRule(f"{L}experts.{e}.fc1.weight", (gate_up,), "replicated", shapes=((E, 2 * f, h),),
                             expert=e) for e in experts]
        rules += [TensorRule(f"{L}experts.{e}.fc2.weight", (down,), "replicated", shapes=((E, h, f),), expert=e)
                  for e in experts]
    for e in () if m.fused_experts else experts:
        rules += _expert_rules(f"{L}experts.{e}.", f"{p}experts.{e}.", names.projections, h, m.expert_ffn_size)
    if m.score_correction_bias:  # DeepSeek's router: kept, not trained (`models/routing.py`)
        rules.append(TensorRule(L + "score_bias.bias", (p + "gate.e_score_correction_bias",), "replicated",
                                shapes=((m.num_experts,),)))
    if m.shared_expert_ffn_size:
        rules += _expert_rules(L + "shared.", p + on_disk.shared, names.projections, h, m.shared_expert_ffn_size)
    if m.shared_expert_ffn_size and m.shared_expert_gate:
        rules.append(TensorRule(L + "shared_gate.weight", (p + "shared_expert_gate.weight",), "replicated",
                                shapes=((1, h),)))
    return rules


MoERules = Callable[[ModelConfig, int, Collection[int]], list[TensorRule]]


def layer_rules(cfg: ModelConfig, i: int, experts: Collection[int], on_disk: ExpertNames = MLP,
                moe_rules: MoERules | None = None) -> list[TensorRule]:
    """Decoder layer i's rules; `on_disk`: how the family's checkpoints name per-expert tensors; `moe_rules`: an
    MoE layer's rules where they are not this layout's (gpt-oss)."""
    p, L = layer_prefix(i), f"layers.{i}."
    a, m = p + "self_attn.", p + "mlp."
    shape = cfg.attention_shape(i)
    qkv = ("q_proj", "k_proj", "v_proj")[:1 + shape.kv_parts]  # no v_proj where the values are the keys
    rules = [
        TensorRule(L + "attn.qkv.weight", tuple(f"{a}{n}.weight" for n in qkv), "qkv", layer=i),
        TensorRule(L + "attn.out.weight", (a + "o_proj.weight",), "cols", layer=i),
    ]
    # With sandwich norms (Gemma, OLMo) HF's post_attention_layernorm is the attention output's norm and the
    # pre-MLP norm is pre_feedforward_layernorm; without them post_attention_layernorm is the pre-MLP norm.
    if cfg.pre_norms:
        pre_mlp = "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"
        rules += [TensorRule(L + "input_norm.weight", (p + "input_layernorm.weight",), "replicated"),
                  TensorRule(L + "post_attn_norm.weight", (p + pre_mlp + ".weight",), "replicated")]
    if cfg.sandwich_norms:
        rules += [TensorRule(L + "attn_out_norm.weight", (p + "post_attention_layernorm.weight",), "replicated"),
                  TensorRule(L + "mlp_out_norm.weight", (p + "post_feedforward_layernorm.weight",), "replicated")]
    if cfg.qk_norm and cfg.qk_norm_whole:
        # Rows by head: a TP rank's whole KV groups are contiguous q heads and contiguous kv heads.
        q, kv = cfg.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        rules += [TensorRule(L + "attn.q_norm.weight", (a + "q_norm.weight",), "rows", shapes=((q,),)),
                  TensorRule(L + "attn.k_norm.weight", (a + "k_norm.weight",), "rows", shapes=((kv,),))]
    elif cfg.qk_norm:
        d = (shape.head_dim,)
        rules.append(TensorRule(L + "attn.q_norm.weight", (a + "q_norm.weight",), "replicated", shapes=(d,)))
        if not shape.reused:  # a layer reusing another's keys (Gemma 4's KV sharing) has no key norm
            rules.append(TensorRule(L + "attn.k_norm.weight", (a + "k_norm.weight",), "replicated", shapes=(d,)))
    if not cfg.is_sparse(i) or cfg.moe.beside_dense:  # Gemma 4's dense MLP runs beside its experts
        f, h = cfg.ffn_size_of(i), cfg.hidden_size
        wide = i in cfg.wide_mlp_layers  # Gemma 4's double-wide MLPs: their shapes are not the model's `ffn_size`
        rules += [
            TensorRule(L + "mlp.fc1.weight", (m + "gate_proj.weight", m + "up_proj.weight"), "gate_up",
                       shapes=((f, h), (f, h)) if wide else None),
            TensorRule(L + "mlp.fc2.weight", (m + "down_proj.weight",), "cols", shapes=((h, f),) if wide else None),
        ]
    if cfg.layer_scalar:
        rules.append(TensorRule(L + "layer_scalar", (p + "layer_scalar",), "replicated", shapes=((1,),)))
    if cfg.qkv_bias:
        rules.append(TensorRule(L + "attn.qkv.bias", tuple(f"{a}{n}.bias" for n in qkv), "qkv", layer=i))
    if cfg.out_bias:
        rules.append(TensorRule(L + "attn.out.bias", (a + "o_proj.bias",), "replicated"))
    if cfg.mlp_bias:
        rules.append(TensorRule(L + "mlp.fc1.bias", (m + "gate_proj.bias", m + "up_proj.bias"), "gate_up"))
        rules.append(TensorRule(L + "mlp.fc2.bias", (m + "down_proj.bias",), "replicated"))
    if not cfg.is_sparse(i):
        return rules
    return rules + (moe_rules(cfg, i, experts) if moe_rules else _moe_rules(cfg, i, experts, on_disk))


def llama_layout(model_types: tuple[str, ...], architecture: str, normalise: Callable[[PretrainedConfig], ModelConfig],
                 *, experts: ExpertNames | None = None, peft: PeftNames = PeftNames(PROJECTIONS)) -> FamilySpec:
    """The spec of a family with the LLaMA weight layout."""
    def rules(cfg: ModelConfig, i: int, held: Collection[int]) -> list[TensorRule]:
        return layer_rules(cfg, i, held, experts or MLP)
    return FamilySpec(model_types, architecture, normalise, rules, embedding="model.embed_tokens.weight", final_norm="model.norm",
                      experts=experts, peft=peft, carried=rope_buffer)


def rope_buffer(name: str, config: dict) -> bool:
    """The RoPE frequencies older LLaMA-layout checkpoints hold per layer (`self_attn.rotary_emb.inv_freq`, a buffer
    transformers < 4.31 saved): transformers computes its own and ignores them, so they are carried verbatim."""
    return name.endswith(".self_attn.rotary_emb.inv_freq")


LLAMA = llama_layout(("llama",), "LlamaForCausalLM", decoder_config)
