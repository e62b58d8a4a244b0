"""Tensor names and shapes of each family's Hugging Face checkpoint, from its config.json.

One small function per architecture ([out, in] for linear weights, as torch stores them, experts
unstacked unless the family publishes them fused); `tensor_shapes(config)` picks the family's.
deltafin-synth (tools/synth.py) writes random values in these shapes; tests/test_synth.py and
tests/test_transformers_facts.py check them against transformers.
"""
from __future__ import annotations

from deltafin.runtime import archinfo
from deltafin.runtime.layerkinds import RecurrentState


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
