"""The real models the built-in recipes are laid out for, as config.json dicts written from their documented sizes
(no Hub access in tests), and the GPUs each recipe runs on (H100 80 GB). `hfmeg plan --model` reads them."""

from __future__ import annotations

GPT_OSS_20B = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                   num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, attention_bias=True, swiglu_limit=7.0, router_aux_loss_coef=0.9,
                   output_router_logits=False, tie_word_embeddings=False,
                   rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                        beta_slow=1.0, truncate=False, original_max_position_embeddings=4096))
QWEN3_5_9B = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
                  num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
                  linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_num_key_heads=16, linear_num_value_heads=32, full_attention_interval=4,
                  max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))
DEEPSEEK_V3 = dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                   moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                   n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512,
                   q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8,
                   topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3, norm_topk_prob=True,
                   max_position_embeddings=163840, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_interleave=True,
                   rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, beta_fast=32.0,
                                        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0,
                                        original_max_position_embeddings=4096))
QWEN3_8B = dict(model_type='qwen3', vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-06, rope_theta=1000000, tie_word_embeddings=False, hidden_act='silu', attention_bias=False)
GEMMA3_12B = dict(model_type='gemma3_text', vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256, max_position_embeddings=131072, rms_norm_eps=1e-06, rope_theta=1000000, rope_local_base_freq=10000, rope_scaling={'factor': 8.0, 'rope_type': 'linear'}, query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6, hidden_activation='gelu_pytorch_tanh', final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True, attention_bias=False)
PHI4 = dict(model_type='phi3', vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10, max_position_embeddings=16384, original_max_position_embeddings=16384, rms_norm_eps=1e-05, rope_theta=250000, rope_scaling=None, tie_word_embeddings=False, hidden_act='silu', resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0, partial_rotary_factor=1.0, sliding_window=None, pad_token_id=100349, bos_token_id=100257, eos_token_id=100265)
# recipe -> (its model's config.json, its GPUs); the other recipes' arithmetic is the YAML's own
RECIPE_MODELS = {"sft_gpt_oss": (GPT_OSS_20B, 8), "sft_qwen3_5": (QWEN3_5_9B, 8), "sft_deepseek_v3": (DEEPSEEK_V3, 256),
                 "sft_qwen3": (QWEN3_8B, 8), "sft_gemma3": (GEMMA3_12B, 8), "sft_phi4": (PHI4, 8)}
