"""Hugging Face config.json files for deltafin-synth: hub style (what published checkpoints carry).

`hub_config` makes a tiny config of any supported family that transformers and mlx-lm both read;
`published` nests it as the family publishes it; PRESETS hold real models' shapes for full-size
benchmark stores, with what each preset assumes beyond its published config in PRESET_ASSUMPTIONS.
"""
from __future__ import annotations

INIT_STD = 0.02  # transformers' initializer_range, used for 1-D biases
BOS_ID, EOS_ID = 0, 2  # the synthetic tokenizer's (tools/synth.py SPECIALS)


def published(config: dict) -> dict:
    """The config.json a family publishes: Qwen3.5-MoE nests its language model in text_config."""
    if config["model_type"] != "qwen3_5_moe" or "text_config" in config:
        return config
    text = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "dtype")}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": {**text, "model_type": "qwen3_5_moe_text"},
            "tie_word_embeddings": config["tie_word_embeddings"], "torch_dtype": config["torch_dtype"],
            "dtype": config["dtype"]}


def _round64(x: float) -> int:
    return max(64, int(round(x / 64)) * 64)


def rope_parameters(theta: float, rope_scaling: dict | None) -> dict:
    """transformers 5's rope_parameters from the older rope_theta + rope_scaling pair."""
    extra = {k: v for k, v in (rope_scaling or {}).items() if k not in ("type", "rope_type")}
    kind = (rope_scaling or {}).get("type") or (rope_scaling or {}).get("rope_type") or "default"
    return {"rope_type": kind, "rope_theta": theta, **extra}


def hub_config(arch: str, *, layers: int, experts: int, top_k: int, hidden: int, moe_intermediate: int,
               vocab: int, dtype: str = "float32", heads: int | None = None,
               q_lora_rank: int | None = None) -> dict:
    """A config.json that both transformers and mlx-lm read, with dims fit for group-64 quantization."""
    heads = heads or max(1, hidden // 32)
    arch_name = {"mixtral": "Mixtral", "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe",
                 "deepseek_v2": "DeepseekV2", "deepseek_v3": "DeepseekV3", "qwen3_next": "Qwen3Next",
                 "qwen3_5_moe": "Qwen3_5Moe", "glm4_moe": "Glm4Moe", "minimax_m2": "MiniMaxM2",
                 "gpt_oss": "GptOss", "kimi_linear": "KimiLinear", "kimi_k3": "KimiK3"}[arch]
    theta = {"mixtral": 1e6, "qwen2_moe": 1e6, "qwen3_moe": 1e6}.get(arch, 10000.0)
    c = {"architectures": [f"{arch_name}ForCausalLM"], "model_type": arch, "vocab_size": vocab,
         "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
         "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2),
         "num_experts_per_tok": top_k, "hidden_act": "silu", "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-6, "initializer_range": INIT_STD, "tie_word_embeddings": False,
         "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": None, "use_cache": True,
         "attention_dropout": 0.0, "router_aux_loss_coef": 0.001, "output_router_logits": False,
         # old and new spellings: mlx-lm reads rope_theta/torch_dtype, transformers 5 rope_parameters/dtype
         "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
         "torch_dtype": dtype, "dtype": dtype}
    if arch in ("glm4_moe", "minimax_m2", "gpt_oss"):
        c.update(_glm_minimax_gptoss_config(arch, c, experts, moe_intermediate))
    elif arch in ("mixtral", "olmoe"):  # their experts are intermediate_size wide
        c["intermediate_size"] = moe_intermediate
        c["num_local_experts" if arch == "mixtral" else "num_experts"] = experts
        if arch == "olmoe":
            c.update(norm_topk_prob=False, attention_bias=False, clip_qkv=None)
        else:
            c["sliding_window"] = None
    elif arch in ("qwen2_moe", "qwen3_moe"):
        c.update(num_experts=experts, moe_intermediate_size=moe_intermediate, decoder_sparse_step=1,
                 mlp_only_layers=[], use_sliding_window=False, sliding_window=None, max_window_layers=layers)
        if arch == "qwen2_moe":
            c.update(shared_expert_intermediate_size=2 * moe_intermediate, qkv_bias=True, norm_topk_prob=False)
        else:  # transformers 5 calls it num_local_experts, mlx-lm and the hub num_experts
            c.update(num_local_experts=experts, head_dim=hidden // heads, norm_topk_prob=True,
                     attention_bias=False)
    elif arch in ("qwen3_next", "qwen3_5_moe"):
        c.update(_hybrid_config(hidden, heads, layers, experts, moe_intermediate))
        c["rope_parameters"]["partial_rotary_factor"] = c["partial_rotary_factor"]
    elif arch.startswith("kimi"):
        c.update(_kimi_config(arch, layers, experts, top_k, heads, moe_intermediate, q_lora_rank))
    else:
        v3 = arch == "deepseek_v3"
        # v3: group-limited routing (4 groups, best 2) whenever top_k fits in the kept groups
        n_group = 4 if v3 and experts % 4 == 0 and top_k <= 2 * (experts // 4) else 1
        c.update(num_key_value_heads=heads, n_routed_experts=experts, moe_intermediate_size=moe_intermediate,
                 n_shared_experts=1 if v3 else 2, first_k_dense_replace=1, moe_layer_freq=1,
                 kv_lora_rank=_round64(hidden / 2), q_lora_rank=q_lora_rank if not v3 else
                 (q_lora_rank or _round64(hidden / 2)),
                 qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                 n_group=n_group, topk_group=max(1, n_group // 2), attention_bias=False,
                 topk_method="noaux_tc" if v3 else "greedy", scoring_func="sigmoid" if v3 else "softmax",
                 norm_topk_prob=v3, routed_scaling_factor=2.5 if v3 else 1.0, aux_loss_alpha=0.001,
                 seq_aux=True)
        # published DeepSeek configs use yarn, and mlx-lm's deepseek_v2 requires it; a real factor
        # (not 1) so the runtime's yarn frequencies and attention mscale get compared to references
        yarn = {"factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32.0, "beta_slow": 1.0,
                "mscale": 0.707, "mscale_all_dim": 0.707}
        c["rope_scaling"] = {"type": "yarn", **yarn}
        c["rope_parameters"] = rope_parameters(theta, c["rope_scaling"])
        if v3:
            c.update(num_nextn_predict_layers=0, rope_interleave=True)
    return c


def _hybrid_config(hidden: int, heads: int, layers: int, experts: int, moe_intermediate: int) -> dict:
    """Qwen3-Next / Qwen3.5-MoE keys: linear and full attention alternating (both spellings:
    mlx-lm reads full_attention_interval, transformers layer_types), partial rope at the top level
    (mlx-lm's Qwen3-Next) and in rope_parameters (transformers, mlx-lm's Qwen3.5)."""
    return dict(num_experts=experts, moe_intermediate_size=moe_intermediate, decoder_sparse_step=1,
                mlp_only_layers=[], shared_expert_intermediate_size=moe_intermediate, norm_topk_prob=True,
                head_dim=hidden // heads, attention_bias=False, partial_rotary_factor=0.25,
                linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
                linear_key_head_dim=hidden // heads, linear_value_head_dim=hidden // heads,
                linear_conv_kernel_dim=4, full_attention_interval=2,
                layer_types=["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)])


def _glm_minimax_gptoss_config(arch: str, c: dict, experts: int, moe_intermediate: int) -> dict:
    """The keys of GLM-4.5, MiniMax-M2 and gpt-oss configs, spelled for mlx-lm (top-level rope_theta,
    partial_rotary_factor, rotary_dim) and transformers 5 (rope_parameters) alike."""
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    theta = c["rope_theta"]
    if arch == "glm4_moe":  # first layer dense, groups and scaling like DeepSeek-V3, partial rotary
        return dict(n_routed_experts=experts, moe_intermediate_size=moe_intermediate, n_shared_experts=1,
                    first_k_dense_replace=1, n_group=2 if experts % 2 == 0 else 1, topk_group=1,
                    routed_scaling_factor=2.5, norm_topk_prob=True, head_dim=head_dim, partial_rotary_factor=0.5,
                    use_qk_norm=True, attention_bias=True, num_nextn_predict_layers=0, topk_method="noaux_tc",
                    scoring_func="sigmoid", rope_scaling=None,
                    rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5})
    if arch == "minimax_m2":  # experts intermediate_size wide; RoPE on half of each head
        return dict(num_local_experts=experts, intermediate_size=moe_intermediate, head_dim=head_dim,
                    rotary_dim=head_dim // 2, use_qk_norm=True, scoring_func="sigmoid", shared_intermediate_size=0,
                    rope_parameters={"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": 0.5})
    # gpt-oss: sliding (window 8) and full layers alternating, attention biases and sinks
    layers = c["num_hidden_layers"]
    return dict(num_local_experts=experts, intermediate_size=moe_intermediate, head_dim=head_dim,
                sliding_window=8, attention_bias=True, swiglu_limit=7.0,
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])


def _kimi_config(arch, layers, experts, top_k, heads, moe_intermediate, q_lora_rank) -> dict:
    """Kimi Linear / K3 keys (mlx-lm's ModelArgs): KDA in every other layer from the first, MLA
    (64 + 32 wide heads, no rotary embedding) between, the first layer dense, grouped routing; K3
    adds SiTU, a latent expert width of 64, attention residuals in blocks of 2 and MLA's output gate."""
    n_group = 2 if experts % 2 == 0 and top_k <= experts // 2 else 1
    c = dict(num_key_value_heads=heads, head_dim=64, model_max_length=4096, num_experts=experts,
             num_experts_per_token=top_k, moe_intermediate_size=moe_intermediate, num_shared_experts=1,
             kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, mla_use_nope=True,
             moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=2.5,
             first_k_dense_replace=1, moe_layer_freq=1, use_grouped_topk=True, num_expert_group=n_group,
             topk_group=max(1, n_group // 2), rms_norm_eps=1e-5,
             linear_attn_config={"num_heads": heads, "head_dim": 64, "short_conv_kernel_size": 4,
                                 "kda_layers": list(range(1, layers + 1, 2)),
                                 "full_attn_layers": list(range(2, layers + 1, 2))})
    if arch == "kimi_k3":
        c["linear_attn_config"]["gate_lower_bound"] = -5.0
        c.update(hidden_act="situ", activation_situ_beta=1.5, activation_situ_linear_beta=4.0,
                 attn_res_block_size=2, q_lora_rank=q_lora_rank or 64, mla_use_output_gate=True,
                 routed_expert_hidden_size=64, latent_moe_use_norm=True)
    return c


# Real model shapes for `bench` (values from the published config.json files).
_DS = dict(hidden_act="silu", rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
           moe_layer_freq=1, first_k_dense_replace=1, qk_nope_head_dim=128, qk_rope_head_dim=64,
           v_head_dim=128, kv_lora_rank=512, initializer_range=INIT_STD, aux_loss_alpha=0.001, seq_aux=True)
PRESETS = {
    "dsv2-lite": dict(_DS, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                      vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                      num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                      n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.0, q_lora_rank=None,
                      topk_method="greedy", n_group=1, topk_group=1, scoring_func="softmax",
                      norm_topk_prob=False, max_position_embeddings=163840, rope_theta=10000.0,
                      rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_local_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                          tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
                          use_sliding_window=False, sliding_window=None, initializer_range=INIT_STD),
    # Qwen3.5-35B-A3B's language model (transformers' Qwen3_5MoeTextConfig defaults, which name it;
    # Qwen3.6-35B-A3B has the same shapes): 3 Gated DeltaNet layers to 1 gated attention layer
    "qwen3.5-35b-a3b": dict(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe", vocab_size=248320,
                            hidden_size=2048, intermediate_size=6144, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, num_hidden_layers=40, num_attention_heads=16,
                            num_key_value_heads=2, head_dim=256, num_experts=256, num_experts_per_tok=8,
                            norm_topk_prob=True, linear_num_key_heads=16, linear_num_value_heads=32,
                            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                            full_attention_interval=4, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
                            rope_theta=1e7, max_position_embeddings=262144, tie_word_embeddings=False,
                            hidden_act="silu", attention_bias=False, initializer_range=INIT_STD),
    # Kimi-K2 publishes model_type "kimi_k2"; it is deepseek_v3 underneath, so say that directly.
    "kimi-k2": dict(_DS, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=163840,
                    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                    num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384,
                    num_experts_per_tok=8, routed_scaling_factor=2.827, q_lora_rank=1536, topk_method="noaux_tc",
                    n_group=1, topk_group=1, scoring_func="sigmoid", norm_topk_prob=True,
                    max_position_embeddings=131072, rope_theta=50000.0, num_nextn_predict_layers=0,
                    rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                  "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    # Kimi K3: what mlx-lm 0.32.2's kimi_k3 TextArgs defaults give (93 layers, hidden 7168, 96 heads,
    # top-16, vocab 163840, intermediate 33792) and the seed (2.8 T parameters, ~32 B active);
    # every other value is assumed, named in PRESET_ASSUMPTIONS.
    "kimi-k3": dict(architectures=["KimiK3ForCausalLM"], model_type="kimi_k3", vocab_size=163840,
                    hidden_size=7168, intermediate_size=33792, num_hidden_layers=93, num_attention_heads=96,
                    num_key_value_heads=96, num_experts_per_token=16, num_experts=1536,
                    moe_intermediate_size=1792,
                    routed_expert_hidden_size=3584, latent_moe_use_norm=False, num_shared_experts=1,
                    first_k_dense_replace=1, moe_layer_freq=1, num_expert_group=1, topk_group=1,
                    routed_scaling_factor=2.5, moe_renormalize=True, moe_router_activation_func="sigmoid",
                    hidden_act="situ", activation_situ_beta=1.0, attn_res_block_size=8, q_lora_rank=1536,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    mla_use_nope=True, mla_use_output_gate=False, rms_norm_eps=1e-5, rope_theta=50000.0,
                    max_position_embeddings=1048576, tie_word_embeddings=False, initializer_range=INIT_STD,
                    linear_attn_config={"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                                        "kda_layers": [i for i in range(1, 94) if i % 4],
                                        "full_attn_layers": list(range(4, 94, 4))}),
}
PRESET_ASSUMPTIONS = {
    "kimi-k3": ["num_experts 1536, moe_intermediate_size 1792 and routed_expert_hidden_size 3584 (latent experts "
                "of 3 x 3584 x 1792 = 19.3 M parameters): chosen so 92 MoE layers hold 2.7 T routed parameters "
                "and top-16 activates 28 B of them, the seed's 2.8 T / ~32 B",
                "first_k_dense_replace 1 and one shared expert, as Kimi K2 and Kimi Linear",
                "SiTU beta 1.0 (mlx-lm's default), attention residuals in blocks of 8 layers",
                "KDA in 3 of every 4 layers, MLA in every 4th (Kimi Linear's 3:1), 96 KDA heads of 128",
                "MLA widths of Kimi K2 (q_lora_rank 1536, kv_lora_rank 512, 128 + 64 / 128 per head)"],
}
