"""Synthetic models for tests and benchmarks (no downloads, no torch).

  deltafin-synth tiny ARCH OUT    tiny random Hugging Face checkpoint (config, safetensors, tokenizer);
                                  --set KEY=JSON (repeatable) overrides a config key before the shapes follow
  deltafin-synth bench PRESET OUT full-size random deltafin store written at disk speed
  deltafin-synth demo OUT         the demo store built from SmolLM2-135M-Instruct (tools/demo_model.py)

All tensor names and shapes come from tensor_shapes(config): one small function per
architecture, shared by both subcommands, checked against transformers in tests/test_synth.py.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
from deltafin.runtime import archinfo
from deltafin.runtime.cli import Help
from deltafin.runtime.layerkinds import RecurrentState
from deltafin.runtime.tensorfile import SafetensorsSpool
from deltafin.tools.convert import progress_bar
from deltafin.tools.demo_model import add_demo_parser

TINY_ARCHS = tuple(archinfo.ARCHS)
INIT_STD = 0.02  # transformers' initializer_range, used for 1-D biases

# ---------------------------------------------------------------------------------------------
# Tensor names and shapes per architecture ([out, in] for linear weights, as torch stores them)
# ---------------------------------------------------------------------------------------------


def _linear(name: str, out: int, inp: int, bias: bool = False) -> dict:
    t = {f"{name}.weight": (out, inp)}
    if bias:
        t[f"{name}.bias"] = (out,)
    return t


def _glu(prefix: str, hidden: int, inter: int, names=("gate_proj", "up_proj", "down_proj")) -> dict:
    gate, up, down = names
    return {**_linear(f"{prefix}.{gate}", inter, hidden), **_linear(f"{prefix}.{up}", inter, hidden),
            **_linear(f"{prefix}.{down}", hidden, inter)}


def _routed(c: dict, p: str, inter: int) -> dict:
    """Router plus per-expert weights, named the way archinfo says the checkpoint names them."""
    info = archinfo.arch_for(c)
    canon = {v: k for k, v in info.proj_names.items()}  # canonical -> checkpoint name (w1, ...)
    names = (canon["gate_proj"], canon["up_proj"], canon["down_proj"])
    n, hidden = archinfo.n_experts(c), c["hidden_size"]
    t = _linear(f"{p}.{info.block}.gate", n, hidden)
    for e in range(n):
        t.update(_glu(f"{p}.{info.block}.experts.{e}", hidden, inter, names))
    return t


def _gqa(c: dict, p: str, bias: bool = False, o_bias: bool = False, qk_norm: str | None = None) -> dict:
    """Grouped-query attention; qk_norm "head" = per-head RMSNorm (qwen3), "full" = whole width (olmoe)."""
    h, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    hd = c.get("head_dim") or h // nh
    t = {**_linear(f"{p}.self_attn.q_proj", nh * hd, h, bias), **_linear(f"{p}.self_attn.k_proj", nkv * hd, h, bias),
         **_linear(f"{p}.self_attn.v_proj", nkv * hd, h, bias), **_linear(f"{p}.self_attn.o_proj", h, nh * hd, o_bias)}
    if qk_norm == "head":
        t.update({f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)})
    elif qk_norm == "full":
        t.update({f"{p}.self_attn.q_norm.weight": (nh * hd,), f"{p}.self_attn.k_norm.weight": (nkv * hd,)})
    return t


def _mla(c: dict, p: str) -> dict:
    """DeepSeek multi-head latent attention (q_lora_rank None means a plain q_proj)."""
    h, nh, a = c["hidden_size"], c["num_attention_heads"], f"{p}.self_attn"
    nope, rope, vd = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    kv_r, q_r, bias = c["kv_lora_rank"], c.get("q_lora_rank"), bool(c.get("attention_bias"))
    if q_r:
        t = {**_linear(f"{a}.q_a_proj", q_r, h, bias), f"{a}.q_a_layernorm.weight": (q_r,),
             **_linear(f"{a}.q_b_proj", nh * (nope + rope), q_r)}
    else:
        t = _linear(f"{a}.q_proj", nh * (nope + rope), h)
    t.update({**_linear(f"{a}.kv_a_proj_with_mqa", kv_r + rope, h, bias), f"{a}.kv_a_layernorm.weight": (kv_r,),
              **_linear(f"{a}.kv_b_proj", nh * (nope + vd), kv_r), **_linear(f"{a}.o_proj", h, nh * vd, bias)})
    return t


def _decoder(c: dict, layer) -> dict:
    """Embedding, final norm, head and per-layer norms around layer(i, prefix, is_moe) -> dict."""
    h, v = c["hidden_size"], c["vocab_size"]
    moe = set(archinfo.moe_layers(c))
    t = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not c.get("tie_word_embeddings"):
        t["lm_head.weight"] = (v, h)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t.update({f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)})
        t.update(layer(i, p, i in moe))
    return t


def _mixtral(c):
    return _decoder(c, lambda i, p, moe: {**_gqa(c, p), **_routed(c, p, c["intermediate_size"])})


def _olmoe(c):
    b = bool(c.get("attention_bias"))
    return _decoder(c, lambda i, p, moe: {**_gqa(c, p, b, b, qk_norm="full"), **_routed(c, p, c["intermediate_size"])})


def _qwen_mlp(c, p, moe, shared: bool):
    if not moe:
        return _glu(f"{p}.mlp", c["hidden_size"], c["intermediate_size"])
    t = _routed(c, p, c["moe_intermediate_size"])
    if shared:  # qwen2_moe: one wide shared expert behind a sigmoid gate
        t.update(_glu(f"{p}.mlp.shared_expert", c["hidden_size"], c["shared_expert_intermediate_size"]))
        t.update(_linear(f"{p}.mlp.shared_expert_gate", 1, c["hidden_size"]))
    return t


def _qwen2_moe(c):
    b = c.get("qkv_bias", True)
    return _decoder(c, lambda i, p, moe: {**_gqa(c, p, b), **_qwen_mlp(c, p, moe, shared=True)})


def _qwen3_moe(c):
    b = bool(c.get("attention_bias"))
    return _decoder(c, lambda i, p, moe: {**_gqa(c, p, b, b, qk_norm="head"), **_qwen_mlp(c, p, moe, shared=False)})


def _deepseek(c):
    def layer(i, p, moe):
        t = _mla(c, p)
        if not moe:
            return {**t, **_glu(f"{p}.mlp", c["hidden_size"], c["intermediate_size"])}
        t.update(_routed(c, p, c["moe_intermediate_size"]))
        if c.get("n_shared_experts"):
            t.update(_glu(f"{p}.mlp.shared_experts", c["hidden_size"],
                          c["moe_intermediate_size"] * c["n_shared_experts"]))
        if archinfo.arch_for(c).model_type == "deepseek_v3":  # present whatever the topk_method
            t[f"{p}.mlp.gate.e_score_correction_bias"] = (archinfo.n_experts(c),)
        return t
    return _decoder(c, layer)


def _gated_delta(c: dict, p: str) -> dict:
    """A Gated DeltaNet layer: Qwen3-Next's fused in_proj_qkvz / in_proj_ba, or Qwen3.5's four."""
    h, a = c["hidden_size"], f"{p}.linear_attn"
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    key, value = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"]
    t = {f"{a}.A_log": (nv,), f"{a}.dt_bias": (nv,), f"{a}.norm.weight": (c["linear_value_head_dim"],),
         f"{a}.conv1d.weight": (2 * key + value, 1, c["linear_conv_kernel_dim"]), **_linear(f"{a}.out_proj", h, value)}
    if c["model_type"] == "qwen3_next":
        return {**t, **_linear(f"{a}.in_proj_qkvz", 2 * key + 2 * value, h), **_linear(f"{a}.in_proj_ba", 2 * nv, h)}
    return {**t, **_linear(f"{a}.in_proj_qkv", 2 * key + value, h), **_linear(f"{a}.in_proj_z", value, h),
            **_linear(f"{a}.in_proj_b", nv, h), **_linear(f"{a}.in_proj_a", nv, h)}


def _hybrid(c):
    """Qwen3-Next / Qwen3.5-MoE as transformers writes them: the layer kinds from archinfo, the q
    projection twice as wide (its output gate), a shared expert everywhere."""
    kinds = archinfo.layer_caches(c)

    def layer(i, p, moe):
        if isinstance(kinds[i], RecurrentState):
            t = _gated_delta(c, p)
        else:
            t = _gqa(c, p, qk_norm="head")
            t[f"{p}.self_attn.q_proj.weight"] = (2 * t[f"{p}.self_attn.q_proj.weight"][0], c["hidden_size"])
        return {**t, **_qwen_mlp(c, p, moe, shared=True)}
    return _decoder(c, layer)


def _qwen3_5_moe(c):
    """Flat config: transformers' Qwen3_5MoeForCausalLM layout. Nested (text_config), as
    published: model.language_model.* with each layer's experts fused, gate_up_proj [E, 2I, H] and
    down_proj [E, H, I]."""
    if "text_config" not in c:
        return _hybrid(c)
    text = archinfo.text_model(c)
    out, inter, n = {}, text["moe_intermediate_size"], archinfo.n_experts(text)
    for name, shape in _hybrid(text).items():
        if ".mlp.experts." not in name:
            out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = shape
    for layer in archinfo.moe_layers(text):
        e = f"model.language_model.layers.{layer}.mlp.experts"
        out.update({f"{e}.gate_up_proj": (n, 2 * inter, text["hidden_size"]),
                    f"{e}.down_proj": (n, text["hidden_size"], inter)})
    return out


def published(config: dict) -> dict:
    """The config.json a family publishes: Qwen3.5-MoE nests its language model in text_config."""
    if config["model_type"] != "qwen3_5_moe" or "text_config" in config:
        return config
    text = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "dtype")}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": {**text, "model_type": "qwen3_5_moe_text"},
            "tie_word_embeddings": config["tie_word_embeddings"], "torch_dtype": config["torch_dtype"],
            "dtype": config["dtype"]}



def _glm4_moe(c):
    def layer(i, p, moe):
        t = _gqa(c, p, bool(c.get("attention_bias")), qk_norm="head" if c.get("use_qk_norm") else None)
        if not moe:
            return {**t, **_glu(f"{p}.mlp", c["hidden_size"], c["intermediate_size"])}
        t.update(_routed(c, p, c["moe_intermediate_size"]))
        t.update(_glu(f"{p}.mlp.shared_experts", c["hidden_size"], c["moe_intermediate_size"] * c["n_shared_experts"]))
        t[f"{p}.mlp.gate.e_score_correction_bias"] = (archinfo.n_experts(c),)
        return t
    return _decoder(c, layer)


def _minimax_m2(c):
    def layer(i, p, moe):
        t = {**_gqa(c, p, qk_norm="full"), **_routed(c, p, c["intermediate_size"])}
        t[f"{p}.block_sparse_moe.e_score_correction_bias"] = (archinfo.n_experts(c),)
        return t
    return _decoder(c, layer)


def _gpt_oss(c):
    """transformers' GptOss layout: fused experts [E, in, out], gate and up interleaved, with biases."""
    h, n, inter = c["hidden_size"], archinfo.n_experts(c), c["intermediate_size"]

    def layer(i, p, moe):
        t = {**_gqa(c, p, True, True), f"{p}.self_attn.sinks": (c["num_attention_heads"],),
             **_linear(f"{p}.mlp.router", n, h, bias=True)}
        e = f"{p}.mlp.experts"
        t.update({f"{e}.gate_up_proj": (n, h, 2 * inter), f"{e}.gate_up_proj_bias": (n, 2 * inter),
                  f"{e}.down_proj": (n, inter, h), f"{e}.down_proj_bias": (n, h)})
        return t
    return _decoder(c, layer)


def _kda(c: dict, a: str) -> dict:
    """Kimi Delta Attention as the Hugging Face checkpoints hold it: q/k/v projections and their
    depthwise convolutions ([C, 1, K]) apart."""
    h, lin = c["hidden_size"], c["linear_attn_config"]
    nh, d = lin["num_heads"], lin["head_dim"]
    p = nh * d
    t = {f"{a}.A_log": (1, 1, nh, 1) if c["model_type"] == "kimi_linear" else (nh,), f"{a}.dt_bias": (p,),
         f"{a}.o_norm.weight": (d,), **_linear(f"{a}.f_a_proj", d, h), **_linear(f"{a}.f_b_proj", p, d),
         **_linear(f"{a}.b_proj", nh, h), **_linear(f"{a}.g_a_proj", d, h), **_linear(f"{a}.g_b_proj", p, d),
         **_linear(f"{a}.o_proj", h, p)}
    for x in "qkv":
        t.update({**_linear(f"{a}.{x}_proj", p, h), f"{a}.{x}_conv1d.weight": (p, 1, lin["short_conv_kernel_size"])})
    return t


def _kimi(c):
    h, k3 = c["hidden_size"], c["model_type"] == "kimi_k3"
    kda = set(c["linear_attn_config"]["kda_layers"])

    def layer(i, p, moe):
        t = _kda(c, f"{p}.self_attn") if i + 1 in kda else _mla(c, p)
        if k3 and i + 1 not in kda and c.get("mla_use_output_gate"):
            t.update(_linear(f"{p}.self_attn.g_proj", c["num_attention_heads"] * c["v_head_dim"], h))
        if k3 and c.get("attn_res_block_size"):
            for r in ("self_attention_res", "mlp_res"):
                t.update({f"{p}.{r}.proj_weight": (1, h), f"{p}.{r}.norm_weight": (h,)})
        if not moe:
            return {**t, **_glu(f"{p}.mlp", h, c["intermediate_size"])}
        b, inter, n = f"{p}.block_sparse_moe", c["moe_intermediate_size"], c["num_experts"]
        width = c.get("routed_expert_hidden_size") or h
        t.update({**_linear(f"{b}.gate", n, h), f"{b}.gate.e_score_correction_bias": (n,),
                  **_glu(f"{b}.shared_experts", h, inter * c["num_shared_experts"])})
        for e in range(n):
            t.update(_glu(f"{b}.experts.{e}", width, inter, ("w1", "w3", "w2")))
        if k3 and c.get("routed_expert_hidden_size"):
            t.update({**_linear(f"{b}.routed_expert_down_proj", width, h),
                      **_linear(f"{b}.routed_expert_up_proj", h, width)})
            if c.get("latent_moe_use_norm"):
                t[f"{b}.routed_expert_norm.weight"] = (width,)
        return t
    t = _decoder(c, layer)
    if k3 and c.get("attn_res_block_size"):
        t.update({"model.output_attn_res.proj_weight": (1, h), "model.output_attn_res.norm_weight": (h,)})
    return t


SHAPES = {"mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe, "olmoe": _olmoe,
          "deepseek_v2": _deepseek, "deepseek_v3": _deepseek, "qwen3_next": _hybrid, "qwen3_5_moe": _qwen3_5_moe,
          "glm4_moe": _glm4_moe, "minimax_m2": _minimax_m2, "gpt_oss": _gpt_oss, "kimi_linear": _kimi,
          "kimi_k3": _kimi}


def tensor_shapes(config: dict) -> dict[str, tuple]:
    """Every tensor of an HF checkpoint with this config: {name: shape}, experts unstacked."""
    return SHAPES[archinfo.arch_for(config).model_type](config)


# ---------------------------------------------------------------------------------------------
# Hugging Face configs (hub style: what the published config.json files contain)
# ---------------------------------------------------------------------------------------------

def _round64(x: float) -> int:
    return max(64, int(round(x / 64)) * 64)


def _rope_parameters(theta: float, rope_scaling: dict | None) -> dict:
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
        c["rope_parameters"] = _rope_parameters(theta, c["rope_scaling"])
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


# ---------------------------------------------------------------------------------------------
# Random values
# ---------------------------------------------------------------------------------------------

def _is_norm(name: str) -> bool:
    return name.endswith(("norm.weight", "norm_weight"))


def _is_router(name: str) -> bool:
    return name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight"))


def init_std(name: str, shape, in_first: bool = False) -> float:
    """Unit-scale init: std 1/sqrt(fan_in) for matrices (transformers' 0.02 at real widths) and 1 for
    embeddings; in_first: fused experts are [E, in, out] (gpt-oss). Plain 0.02 on a 128-wide model lets attention swamp the token signal: routing piles
    onto a few experts and the experts hardly move the logits, which makes weak test references."""
    if "embed_tokens" in name:
        return 1.0
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # fused [E, out, in]
        return 1.0 / math.sqrt(shape[1] if in_first else shape[-1])  # gpt-oss's: [E, in, out]
    if len(shape) == 2 or name.endswith("conv1d.weight"):
        return 1.0 / math.sqrt(shape[-1])
    if name.endswith("e_score_correction_bias"):
        return 0.1  # transformers uses zeros; nonzero exercises the selection-only bias path
    return INIT_STD  # linear biases (transformers: zeros) so a dropped bias shows in the outputs


def init_tensor(name: str, shape, seed: int, in_first: bool = False) -> np.ndarray:
    """float32 values for one tensor; RMSNorm weights are 1. in_first: see init_std."""
    if _is_norm(name):
        return np.ones(shape, np.float32)
    # per-tensor stream: the values do not depend on the writing order or the sharding
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return rng.normal(0.0, init_std(name, shape, in_first), size=shape).astype(np.float32)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    return to_bf16_bits(x) if dtype == "bfloat16" else x.astype(dtype)




def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> int:
    """{name: (dtype_name, array)} -> a safetensors file transformers accepts; returns data bytes."""
    spool = SafetensorsSpool(path, metadata={"format": "pt"})
    for name, (dt, arr) in tensors.items():
        spool.add(name, dt, arr.shape, arr)
    spool.finish()
    return sum(arr.nbytes for _, arr in tensors.values())


def _natural(name: str):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE trained on a few sentences, padded with reserved tokens to the vocab
# ---------------------------------------------------------------------------------------------

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 = bos, chat start, eos
BOS_ID, EOS_ID = 0, 2
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = """The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few
experts out of many. Experts are streamed from the solid state drive into shared memory when they are needed.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Once upon a time there was a small model that learned to count: one, two, three, four, five, six, seven.
def main():\n    print("hello")\n    return 0\nThe weather is nice and the sky is blue; the sea is calm.
Numbers 0123456789 and symbols (+-*/=<>[]{}) appear in code, in maths and in tables of results.""".splitlines()


def write_tokenizer(out: Path, vocab: int) -> list[Path]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if vocab < 256 + len(SPECIALS):
        raise SystemExit(f"--vocab must be at least {256 + len(SPECIALS)} for a byte-level tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    n = tok.get_vocab_size()
    if n < vocab:  # the corpus ran out of merges: fill the rest so ids cover the embedding exactly
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab - n)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    bos, _, eos = SPECIALS
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": bos,
        "unk_token": None, "add_bos_token": False, "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "pad_token": bos}, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}, indent=1))
    return [out / f for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                              "generation_config.json")]


# ---------------------------------------------------------------------------------------------
# (a) tiny checkpoints
# ---------------------------------------------------------------------------------------------

def _tensor_dtype(name: str, dtype: str) -> str:
    # e_score_correction_bias stays float32, as in the published DeepSeek-V3 checkpoints (and
    # what mlx-lm keeps as stored: the router bias, KDA's A_log and dt_bias)
    return "float32" if name.endswith(("e_score_correction_bias", "A_log", "dt_bias")) else dtype


def write_checkpoint(out: Path, config: dict, dtype: str, seed: int, shards: int = 1) -> Path:
    """config.json + model.safetensors (or N shards with an index) + tokenizer files."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        old.unlink()  # a stale shard from an earlier run would be loaded too
    shapes = tensor_shapes(config)
    names = sorted(shapes, key=_natural)
    sizes = [int(np.prod(shapes[n])) * np.dtype(np.float32 if _tensor_dtype(n, dtype) == "float32"
                                                 else np.float16).itemsize for n in names]
    shards = max(1, min(shards, len(names)))
    total, groups, acc = sum(sizes), [[] for _ in range(shards)], 0
    for n, size in zip(names, sizes):  # contiguous runs of about total/shards bytes each
        groups[min(shards - 1, acc * shards // total)].append(n)
        acc += size
    groups = [g for g in groups if g]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in group:
            dt = _tensor_dtype(n, dtype)
            tensors[n] = (dt, _cast(init_tensor(n, shapes[n], seed, config.get("model_type") == "gpt_oss"), dt))
        write_safetensors(out / fname, tensors)
        weight_map.update({n: fname for n in group})
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out, archinfo.text_model(config)["vocab_size"])
    return out


def for_mlx_lm(path) -> Path:
    """A tiny checkpoint as mlx-lm 0.32.2 reads it: gpt-oss's fused experts split into mlx-lm's own
    layout, experts.{gate,up,down}_proj.weight [E, out, in] and .bias [E, out] (its sanitize reads
    the fused tensors only as OpenAI's mxfp4 blocks), written once to a sibling folder; every other
    family's checkpoint as it is."""
    import shutil

    import mlx.core as mx
    path = Path(path)
    if json.loads((path / "config.json").read_text())["model_type"] != "gpt_oss":
        return path
    out = path.parent / f"{path.name}-mlx"
    if not out.exists():
        shutil.copytree(path, out)
        for f in out.glob("model*.safetensors"):
            w = mx.load(str(f))
            for k in [k for k in w if k.endswith("experts.gate_up_proj")]:
                e = k[: -len("gate_up_proj")]
                gu, gub = w.pop(k).swapaxes(-1, -2), w.pop(f"{e}gate_up_proj_bias")
                w.update({f"{e}gate_proj.weight": gu[:, 0::2], f"{e}up_proj.weight": gu[:, 1::2],
                          f"{e}gate_proj.bias": gub[:, 0::2], f"{e}up_proj.bias": gub[:, 1::2],
                          f"{e}down_proj.weight": w.pop(f"{e}down_proj").swapaxes(-1, -2),
                          f"{e}down_proj.bias": w.pop(f"{e}down_proj_bias")})
            mx.save_safetensors(str(f), {k: mx.contiguous(v) for k, v in w.items()}, metadata={"format": "pt"})
    return out


def with_overrides(config: dict, overrides: dict | None) -> dict:
    """config updated with overrides, keeping the paired spellings in step: rope_parameters (transformers 5)
    with rope_theta + rope_scaling (mlx-lm), num_experts with num_local_experts (qwen3_moe), and
    num_hidden_layers with max_window_layers (qwen). An override given for both spellings is kept as given."""
    if not overrides:
        return dict(config)
    if {"dtype", "torch_dtype"} & overrides.keys():
        raise ValueError("set the checkpoint dtype with dtype=, not overrides (it decides the tensors' dtype)")
    c = {**config, **overrides}
    if "rope_parameters" in overrides:
        rp = dict(overrides["rope_parameters"] or {})
        rp.setdefault("rope_theta", c["rope_theta"])
        c["rope_parameters"] = rp
        if "rope_theta" not in overrides:
            c["rope_theta"] = rp["rope_theta"]
        if "rope_scaling" not in overrides:
            kind = rp.get("rope_type") or rp.get("type") or "default"
            c.pop("rope_scaling", None)
            if kind != "default":
                c["rope_scaling"] = {"type": kind, **{k: v for k, v in rp.items()
                                                      if k not in ("rope_type", "type", "rope_theta")}}
    elif {"rope_scaling", "rope_theta"} & overrides.keys():
        c["rope_parameters"] = _rope_parameters(c["rope_theta"], c.get("rope_scaling"))
    if c["model_type"] == "qwen3_moe":
        for a, b in (("num_experts", "num_local_experts"), ("num_local_experts", "num_experts")):
            if a in overrides and b not in overrides:
                c[b] = overrides[a]
    if "num_hidden_layers" in overrides and "max_window_layers" in c and "max_window_layers" not in overrides:
        c["max_window_layers"] = overrides["num_hidden_layers"]
    return c


def tiny(arch: str, out, *, layers: int | None = None, experts: int = 8, top_k: int = 2, hidden: int = 128,
         moe_intermediate: int = 128, vocab: int = 512, dtype: str = "float32", seed: int = 0, shards: int = 1,
         q_lora_rank: int | None = None, overrides: dict | None = None) -> Path:
    """A tiny random checkpoint. overrides update the hub config before the tensor shapes are derived from it
    (any config key: head_dim, tie_word_embeddings, mlp_only_layers, rope_parameters, n_group, ...)."""
    if arch not in TINY_ARCHS:
        raise SystemExit(f"unknown architecture {arch!r}; choose from {', '.join(TINY_ARCHS)}")
    if not 1 <= top_k <= experts:
        raise SystemExit(f"--top-k must be between 1 and --experts ({experts})")
    if hidden % 64 or moe_intermediate % 64:
        print("warning: --hidden/--moe-intermediate not multiples of 64: some weights will not fit "
              "4-bit group-64 quantization", file=sys.stderr)
    if layers is None:  # deepseek's, glm's and kimi's first layer is dense: keep two MoE layers everywhere
        layers = 3 if arch.startswith(("deepseek", "kimi")) or arch == "glm4_moe" else 2
    config = hub_config(arch, layers=layers, experts=experts, top_k=top_k, hidden=hidden,
                        moe_intermediate=moe_intermediate, vocab=vocab, dtype=dtype, q_lora_rank=q_lora_rank)
    return write_checkpoint(Path(out), published(with_overrides(config, overrides)), dtype, seed, shards)


# ---------------------------------------------------------------------------------------------
# (b) benchmark stores: random packed 4-bit data, no float weights ever materialized
# ---------------------------------------------------------------------------------------------

class _RandomQuant:
    """Random MLX-affine quantized tensors cut from pre-generated pools, so output runs at disk speed.

    Codes are uniform random; scales/biases centre each group on zero with about the given std.
    """

    POOL_BYTES = 64 << 20
    POOL_GROUPS = 1 << 20

    def __init__(self, seed: int, bits: int, group_size: int, dtype: str):
        self.rng = np.random.default_rng(seed)
        self.bits, self.group_size, self.dtype = bits, group_size, dtype
        self.codes = np.frombuffer(self.rng.bytes(self.POOL_BYTES), np.uint32)
        self.jitter = self.rng.uniform(0.8, 1.25, self.POOL_GROUPS).astype(np.float32)
        self._groups: dict[float, tuple[np.ndarray, np.ndarray]] = {}

    def _group_pool(self, std: float):
        if std not in self._groups:  # uniform codes 0..L have std ~ L/sqrt(12)
            levels = (1 << self.bits) - 1
            scale = std * math.sqrt(12) / levels * self.jitter
            self._groups[std] = (_cast(scale, self.dtype), _cast(-0.5 * levels * scale, self.dtype))
        return self._groups[std]

    def _start(self, pool_len: int, n: int) -> int | None:
        """A random window of n items in a pool, or None when the pool is too small to vary it."""
        return int(self.rng.integers(0, pool_len - n)) if 2 * n <= pool_len else None

    def tensor(self, out: int, inp: int, std: float) -> dict[str, np.ndarray]:
        words, groups = inp * self.bits // 32, inp // self.group_size
        nw, ng = out * words, out * groups
        i = self._start(len(self.codes), nw)
        # only embeddings and lm_head outgrow the pools: generate those directly
        w = self.codes[i:i + nw] if i is not None else np.frombuffer(self.rng.bytes(nw * 4), np.uint32)
        scales, biases = self._group_pool(std)
        i = self._start(len(scales), ng)
        sel = slice(i, i + ng) if i is not None else self.rng.integers(0, len(scales), ng)
        s, b = scales[sel], biases[sel]
        return {"weight": w.reshape(out, words), "scales": s.reshape(out, groups),
                "biases": b.reshape(out, groups)}


def _quantize_dense(name: str, shape, group_size: int, config: dict) -> bool:
    """mlx-lm quantizes every Linear/Embedding whose input width fits the groups; routers stay float, and so
    does deepseek_v3's kv_b_proj, which mlx-lm re-splits per head (float keeps that conversion exact)."""
    return (len(shape) == 2 and name.endswith(".weight") and not _is_norm(name) and not _is_router(name)
            and shape[1] % group_size == 0 and shape[0] > 1
            and not (config["model_type"] == "deepseek_v3" and name.endswith("kv_b_proj.weight")))


def bench(preset: str, out, *, layers: int | None = None, bits: int = 4, group_size: int = 64, seed: int = 0,
          dtype: str = "bfloat16", force: bool = False, progress: bool = True) -> Path:
    from deltafin.runtime.store import StoreWriter
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if bits not in (2, 3, 4, 5, 6, 8):
        raise SystemExit(f"unsupported bits {bits} (mlx affine quantization: 2, 3, 4, 5, 6 or 8)")
    config = dict(PRESETS[preset], torch_dtype=dtype, dtype=dtype, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                  pad_token_id=None)
    config["rope_parameters"] = _rope_parameters(config["rope_theta"], config.get("rope_scaling"))
    if layers is not None:
        config["num_hidden_layers"] = layers
        if "max_window_layers" in config:
            config["max_window_layers"] = layers
    info = archinfo.arch_for(config)
    shapes = {archinfo.store_name(info, n): shape for n, shape in tensor_shapes(config).items()}
    pattern = archinfo.expert_pattern(info)
    act = info.activation(config)
    quant = None if act is None else {**{p: {"bits": bits, "group_size": group_size} for p in archinfo.PROJS},
                                      "activation": act}
    experts: dict[tuple[int, int], dict[str, tuple]] = {}
    dense = {}
    for name, shape in shapes.items():
        m = pattern.match(name)
        if m:
            experts.setdefault((int(m[1]), int(m[2])), {})[info.proj_names[m[3]]] = shape
        else:
            dense[name] = shape
    q = _RandomQuant(seed, bits, group_size, dtype)
    writer = StoreWriter(out, config, bits, group_size, force=force,
                         dense_quantization={"bits": bits, "group_size": group_size},
                         extra={"synthetic": {"preset": preset, "seed": seed}})
    with writer:
        for name in sorted(dense, key=_natural):
            shape = dense[name]
            if _quantize_dense(name, shape, group_size, config):
                base = name[: -len(".weight")]
                for k, arr in q.tensor(*shape, init_std(name, shape)).items():
                    writer.add_dense(f"{base}.{k}", "uint32" if k == "weight" else dtype, arr.shape, arr)
            else:
                dt = _tensor_dtype(name, dtype)
                writer.add_dense(name, dt, shape, _cast(init_tensor(name, shape, seed), dt))
        keys = sorted(experts)
        bar = progress_bar(len(keys), f"{preset}: experts", progress, unit="expert")
        for layer, e in keys:
            rec = {}
            for proj, (o, i) in experts[(layer, e)].items():
                rec.update({f"{proj}.{k}": v for k, v in q.tensor(o, i, 1.0 / math.sqrt(i)).items()})
            writer.add_expert(layer, e, rec, quant)
            bar.update(1)
        bar.close()
        with tempfile.TemporaryDirectory() as td:
            for f in write_tokenizer(Path(td), 512):
                writer.add_tokenizer_file(f)
        return writer.finish()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _key_json(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{key}: value is not JSON ({e}); quote strings: {key}='\"...\"'") from None


def _cmd_tiny(a) -> int:
    out = tiny(a.arch, a.out, layers=a.layers, experts=a.experts, top_k=a.top_k, hidden=a.hidden,
               moe_intermediate=a.moe_intermediate, vocab=a.vocab, dtype=a.dtype, seed=a.seed,
               shards=a.shards, q_lora_rank=a.q_lora_rank, overrides=dict(a.set))
    print(f"wrote {a.arch} checkpoint to {out}")
    return 0


def _cmd_bench(a) -> int:
    out = bench(a.preset, a.out, layers=a.layers, bits=a.bits, group_size=a.group_size, seed=a.seed,
                dtype=a.dtype, force=a.force)
    print(f"wrote {a.preset} store to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-synth", description="Synthetic MoE checkpoints and stores.")
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tiny", formatter_class=Help, help="tiny random Hugging Face checkpoint")
    t.add_argument("arch", choices=TINY_ARCHS)
    t.add_argument("out")
    t.add_argument("--layers", type=int, default=None, help="default 2 (3 for deepseek: first is dense)")
    t.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    t.add_argument("--top-k", type=int, default=2, help="experts each token uses per layer")
    t.add_argument("--hidden", type=int, default=128, help="hidden size")
    t.add_argument("--moe-intermediate", type=int, default=128, help="an expert's intermediate size")
    t.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    t.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32", help="dtype of every tensor")
    t.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    t.add_argument("--shards", type=int, default=1, help="safetensors files the weights are split into")
    t.add_argument("--q-lora-rank", type=int, default=None, help="deepseek_v2: use q_a/q_b projections")
    t.add_argument("--set", type=_key_json, action="append", default=[], metavar="KEY=JSON",
                   help="override a config.json key, value in JSON (repeatable): --set n_group=2 "
                        "--set tie_word_embeddings=true --set 'rope_parameters={\"rope_type\": \"default\"}'")
    t.set_defaults(func=_cmd_tiny)

    b = sub.add_parser("bench", formatter_class=Help, help="full-size random store in deltafin's format")
    b.add_argument("preset", choices=tuple(PRESETS))
    b.add_argument("out")
    b.add_argument("--layers", type=int, default=None, help="override the layer count")
    b.add_argument("--bits", type=int, default=4, help="bits per quantized expert weight")
    b.add_argument("--group-size", type=int, default=64, help="weights sharing one scale and bias")
    b.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16",
                   help="dtype of scales, norms and unquantized dense weights")
    b.add_argument("--seed", type=int, default=0, help="random seed of the data")
    b.add_argument("--force", action="store_true", help="replace OUT if it exists")
    b.set_defaults(func=_cmd_bench)

    add_demo_parser(sub)  # the demo model's builder lives in tools/demo_model.py
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
