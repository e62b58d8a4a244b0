"""Model forward passes against mlx-lm (same quantized checkpoint) and transformers (float weights).

Each case is a tiny random Hugging Face checkpoint written by deltafin-synth (numpy only, no torch),
quantized with mlx_lm.convert (4-bit, group 64); teacher-forced logits are compared. The mlx-lm
comparisons need no torch; those against transformers import torch inside the test and skip without it."""

import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm import convert  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from deltafin.runtime.models import (  # noqa: E402
    ResidentExperts, UnsupportedArchitecture, build_model, switch_glu)
from deltafin.runtime.models.base import Linear, QuantSpec  # noqa: E402
from deltafin.runtime.models.switch import uniform_quant  # noqa: E402
from deltafin.tools import synth  # noqa: E402

SEQ = 12
# synth.tiny's defaults: hidden 128, 4 heads (2 kv heads), 2 layers (3 for deepseek, the first dense)
MLA = dict(layers=3, experts=8, moe_intermediate=64)
MLA_CONFIG = dict(n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=128, qk_rope_head_dim=32,
                  qk_nope_head_dim=64, v_head_dim=64)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8)
NO_SCALING = dict(rope_type="default", rope_theta=10000.0)

# case -> (model_type, synth.tiny arguments, config overrides, dtype mlx_lm.convert casts to)
CASES = {
    "mixtral": ("mixtral", dict(experts=4), {}, "bfloat16"),
    "qwen2_moe": ("qwen2_moe", dict(moe_intermediate=64), dict(shared_expert_intermediate_size=128), "bfloat16"),
    "qwen3_moe_tied": ("qwen3_moe", dict(moe_intermediate=64),
                       dict(head_dim=32, norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=True),
                       "bfloat16"),
    "olmoe": ("olmoe", dict(moe_intermediate=64), {}, "float16"),
    "deepseek_v2_yarn": ("deepseek_v2", MLA, dict(MLA_CONFIG, q_lora_rank=None, topk_method="group_limited_greedy",
                                                  n_group=2, topk_group=1, routed_scaling_factor=1.5,
                                                  rope_parameters=YARN), "bfloat16"),
    "deepseek_v3": ("deepseek_v3", MLA, dict(MLA_CONFIG, q_lora_rank=64, n_group=2, topk_group=1,
                                             routed_scaling_factor=2.5, rope_parameters=NO_SCALING), "bfloat16"),
    "deepseek_v3_yarn": ("deepseek_v3", MLA, dict(MLA_CONFIG, q_lora_rank=None, n_group=4, topk_group=2,
                                                  rope_parameters=YARN), "float32"),
    "glm4_moe": ("glm4_moe", dict(experts=8, moe_intermediate=64), {}, "bfloat16"),
    "minimax_m2": ("minimax_m2", dict(experts=8, moe_intermediate=64), {}, "float16"),
}
EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\..*\.experts\.(\d+)\.(\w+)\.weight$")
HF_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass
class Case:
    name: str
    hf_config: dict  # config.json exactly as written (hub style)
    hf_dir: Path
    mlx_dir: Path
    tokens: np.ndarray
    dtype: str  # what mlx_lm.convert cast the quantized checkpoint to


def _randomize_norms(hf_dir: Path):
    # Non-trivial norms (synth writes ones), so a wrong or missing one shows in the logits.
    from safetensors.numpy import load_file, save_file
    path = hf_dir / "model.safetensors"
    weights = load_file(str(path))
    rng = np.random.default_rng(1)
    for name, w in weights.items():
        if "norm" in name:
            weights[name] = (w + 0.2 * rng.standard_normal(w.shape)).astype(w.dtype)
    save_file(weights, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    model_type, tiny_args, overrides, dtype = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = synth.tiny(model_type, root / "hf", overrides=overrides, **tiny_args)  # float32 weights
    _randomize_norms(hf_dir)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    tokens = np.random.default_rng(0).integers(0, hf_config["vocab_size"], SEQ).astype(np.int32)
    convert(str(hf_dir), str(root / "mlx"), quantize=True, q_bits=4, q_group_size=64, dtype=dtype)
    return Case(request.param, hf_config, hf_dir, root / "mlx", tokens, dtype)


def _torch_logits(case) -> np.ndarray:
    """transformers on the float checkpoint (skips the calling test without torch)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        case.hf_dir, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # missing, unexpected, mismatched keys
    with torch.no_grad():
        return hf.eval()(torch.tensor(case.tokens[None], dtype=torch.long)).logits[0].float().numpy()


def _mlx_lm_float_logits(case) -> np.ndarray:
    """mlx-lm on the float checkpoint: a float reference that needs no torch."""
    model, _ = load_model(case.hf_dir)  # strict: raises on missing or unexpected weights
    return np.array(model(mx.array(case.tokens)[None])[0].astype(mx.float32))


# ---------------------------------------------------------------- helpers

def _load(path: Path):
    weights = {}
    for f in sorted(path.glob("model*.safetensors")):
        weights.update(mx.load(str(f)))
    return weights


def _split_mlx_lm(weights):
    """mlx-lm checkpoint -> (dense weights, {layer: stacked experts under canonical names})."""
    dense, experts = {}, {}
    for k, v in weights.items():
        m = re.match(r"^model\.layers\.(\d+)\..*\.switch_mlp\.(\w+\.\w+)$", k)
        if m:
            experts.setdefault(int(m.group(1)), {})[m.group(2)] = v
        else:
            dense[k] = v
    return dense, experts


def _split_hf(weights, quantize=False):
    """HF float checkpoint -> (dense weights, {layer: stacked float or 4-bit experts})."""
    dense, per_expert = {}, {}
    for k, v in weights.items():
        m = EXPERT_RE.match(k)
        if m:
            layer, e, name = int(m.group(1)), int(m.group(2)), HF_EXPERT_NAMES.get(m.group(3), m.group(3))
            per_expert.setdefault(layer, {}).setdefault(name, {})[e] = v
        else:
            dense[k] = v
    experts = {}
    for layer, names in per_expert.items():
        experts[layer] = {}
        for name, by_e in names.items():
            stacked = mx.stack([by_e[e] for e in sorted(by_e)])
            if quantize:
                q, s, b = mx.quantize(stacked, group_size=64, bits=4)
                experts[layer].update({f"{name}.weight": q, f"{name}.scales": s, f"{name}.biases": b})
            else:
                experts[layer][f"{name}.weight"] = stacked
    return dense, experts


def _ours(case, source="mlx"):
    if source == "mlx":
        config = json.loads((case.mlx_dir / "config.json").read_text())
        dense, experts = _split_mlx_lm(_load(case.mlx_dir))
        q = config["quantization"]
        return build_model(config, dense, q, "auto"), ResidentExperts(experts, q["bits"], q["group_size"])
    dense, experts = _split_hf(_load(case.hf_dir), quantize=(source == "hf+q4"))
    return build_model(case.hf_config, dense, None, "auto"), ResidentExperts(experts, 4, 64)


def _stepwise(step, tokens):
    return np.concatenate([np.array(step(tokens[i:i + 1])) for i in range(len(tokens))])


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _assert_close(ours, ref, rel, what):
    diff = _rel(ours, ref)
    assert diff <= rel, f"{what}: max|diff| / max|logit| = {diff:.2e} > {rel:.0e}"
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decided = (top2[:, 1] - top2[:, 0]) > 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1))[decided].all(), f"{what}: argmax differs"
    return diff


# ---------------------------------------------------------------- tests

def test_matches_mlx_lm_on_quantized_checkpoint(case):
    ref_model, _ = load_model(case.mlx_dir)
    ref = np.array(ref_model(mx.array(case.tokens)[None])[0].astype(mx.float32))
    model, experts = _ours(case)
    assert model.moe_layers and model.n_experts > 1 and model.top_k == 2
    if case.hf_config["model_type"] == "qwen3_moe":  # mlx-lm quantizes qwen3's routers to 8 bits
        assert {"group_size": 64, "bits": 8} in json.loads((case.mlx_dir / "config.json").read_text())[
            "quantization"].values()
    calls = []

    def recording(layer, x, inds):
        calls.append((layer, x.shape, inds.shape, inds.dtype))
        return experts(layer, x, inds)

    ours = np.array(model(mx.array(case.tokens), model.make_cache(), recording))
    hidden = case.hf_config["hidden_size"]
    assert calls == [(i, (SEQ, hidden), (SEQ, 2), mx.uint32) for i in model.moe_layers]
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    diff = _assert_close(ours, ref, 1e-3, case.name)
    print(f"\n{case.name}: prefill rel diff vs mlx-lm {diff:.2e}")


def test_decode_matches_mlx_lm_decode(case):
    ref_model, _ = load_model(case.mlx_dir)
    ref_cache = make_prompt_cache(ref_model)
    ref = _stepwise(lambda t: ref_model(mx.array(t)[None], cache=ref_cache)[0].astype(mx.float32), case.tokens)
    model, experts = _ours(case)
    cache = model.make_cache()
    ours = _stepwise(lambda t: model(mx.array(t), cache, experts), case.tokens)
    diff = _assert_close(ours, ref, 1e-3, case.name + " decode")
    print(f"\n{case.name}: decode rel diff vs mlx-lm {diff:.2e}")
    prefill = np.array(model(mx.array(case.tokens), model.make_cache(), experts))
    if case.dtype == "float32":
        _assert_close(ours, prefill, 1e-4, case.name + " decode vs prefill")
    else:
        # In 16-bit, MLA's decode path (query moved to latent space) rounds differently from prefill
        # and can flip a routing choice: mlx-lm shows the same gap, so only bound it loosely, beyond its own.
        ref_prefill = np.array(ref_model(mx.array(case.tokens)[None])[0].astype(mx.float32))
        assert _rel(ours, prefill) < _rel(ref, ref_prefill) + 0.1


def _float_chunked(case):
    model, experts = _ours(case, "hf")
    cache = model.make_cache()
    # Prefill, then a second multi-token chunk at an offset, then single-token decode.
    chunks = [np.array(model(mx.array(case.tokens[a:b]), cache, experts)) for a, b in ((0, 5), (5, 9))]
    return np.concatenate(chunks + [_stepwise(lambda t: model(mx.array(t), cache, experts), case.tokens[9:])])


def test_float_weights_match_mlx_lm(case):
    _assert_close(_float_chunked(case), _mlx_lm_float_logits(case), 1e-4, case.name + " float vs mlx-lm")


def test_float_weights_match_transformers(case):
    ref = _torch_logits(case)
    _assert_close(_float_chunked(case), ref, 1e-4, case.name + " float vs transformers")


def test_float_dense_with_quantized_experts(case):
    model, experts = _ours(case, "hf+q4")
    prefill = np.array(model(mx.array(case.tokens), model.make_cache(), experts))
    assert np.isfinite(prefill).all()
    cache = model.make_cache()
    _assert_close(_stepwise(lambda t: model(mx.array(t), cache, experts), case.tokens), prefill, 1e-4,
                  case.name + " float dense + q4 experts")


def test_unknown_architecture_lists_supported():
    with pytest.raises(UnsupportedArchitecture, match="deepseek_v3.*mixtral"):
        build_model({"model_type": "llama"}, {}, None, "auto")


def test_switch_glu_sorted_path_matches_unsorted():
    # 40 rows x 2 experts = 80 >= 64 takes the sorted path; rows in chunks of 8 stay unsorted.
    E, D, H = 4, 64, 128
    w = {}
    for name, shape in (("gate_proj", (E, H, D)), ("up_proj", (E, H, D)), ("down_proj", (E, D, H))):
        q, s, b = mx.quantize(mx.random.normal(shape, key=mx.random.key(len(name))) * 0.1, 64, 4)
        w.update({f"{name}.weight": q, f"{name}.scales": s, f"{name}.biases": b})
    x = mx.random.normal((40, D), key=mx.random.key(1))
    inds = mx.random.randint(0, E, (40, 2), key=mx.random.key(2)).astype(mx.uint32)
    quant = uniform_quant(w, 4, 64)
    together = switch_glu(x, inds, w, quant)
    chunks = mx.concatenate([switch_glu(x[i:i + 8], inds[i:i + 8], w, quant) for i in range(0, 40, 8)])
    assert together.shape == (40, 2, D)
    assert mx.allclose(together, chunks, atol=1e-5).item()


def test_explicit_dtype_casts_a_16bit_checkpoint(case):
    config = json.loads((case.mlx_dir / "config.json").read_text())
    dense, experts = _split_mlx_lm(_load(case.mlx_dir))
    model = build_model(config, dense, config["quantization"], "float32")
    assert model.dtype == mx.float32 and model.embed.scales.dtype == mx.float32
    logits = np.array(model(mx.array(case.tokens), model.make_cache(), ResidentExperts(experts)))
    assert np.isfinite(logits).all()


def test_quantized_kv_b_proj_is_split_for_absorbed_mla(case, tmp_path):
    if case.hf_config["model_type"] != "deepseek_v3":
        pytest.skip("only DeepSeek-V3 splits kv_b_proj")
    weights = _load(case.hf_dir)  # float, with an 8-bit kv_b_proj
    quantization = {"bits": 4, "group_size": 64}
    for k in [k for k in weights if k.endswith("kv_b_proj.weight")]:
        path = k[: -len(".weight")]
        weights[k], weights[f"{path}.scales"], weights[f"{path}.biases"] = mx.quantize(weights[k], 64, 8)
        quantization[path] = {"bits": 8, "group_size": 64}
    dense, experts = _split_hf(weights)
    model = build_model(case.hf_config, dense, quantization, "auto")
    attn = model.layers[0][1]
    assert attn.kv_b is None and attn.embed_q.quantized and attn.embed_q.bits == 8
    logits = np.array(model(mx.array(case.tokens), model.make_cache(), ResidentExperts(experts)))
    # mlx-lm loading the same weights dequantizes kv_b_proj, splits it per head and re-quantizes the parts
    # too. (Against the float model instead, 8-bit noise can flip a routing choice: no tight bound there.)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp_path / "config.json").write_text(json.dumps({**case.hf_config, "quantization": {"group_size": 64,
                                                                                          "bits": 8}}))
    ref_model, _ = load_model(tmp_path)
    assert ref_model.model.layers[0].self_attn.embed_q.bits == 8
    ref = np.array(ref_model(mx.array(case.tokens)[None])[0].astype(mx.float32))
    diff = _assert_close(logits, ref, 1e-4, case.name + " 8-bit kv_b_proj vs mlx-lm")
    print(f"\n{case.name}: 8-bit kv_b_proj rel diff vs mlx-lm {diff:.2e}")


def test_quantized_bits_inferred_without_override():
    w = {"x.weight": mx.random.normal((8, 128), key=mx.random.key(0))}
    q, s, b = mx.quantize(w["x.weight"], 64, 8)
    lin = Linear({"x.weight": q, "x.scales": s, "x.biases": b}, "x", QuantSpec({"bits": 4, "group_size": 64}))
    assert lin.bits == 8
    x = mx.ones((1, 128))
    assert mx.allclose(lin(x), x @ mx.dequantize(q, s, b, 64, 8).T, atol=1e-4).item()


# Config keys transformers honours but mlx-lm, the numerics reference, ignores: the runtime follows
# mlx-lm. Found by a judge-style run on transformers-5 checkpoints, whose save_pretrained writes the
# rope scaling only inside rope_parameters (mlx-lm reads the top-level rope_scaling alone).
IGNORED_BY_MLX_LM = {
    "qwen2_moe_norm_topk": ("qwen2_moe", dict(moe_intermediate=64), dict(norm_topk_prob=True), False),
    "olmoe_linear_rope_parameters_only": (
        "olmoe", dict(moe_intermediate=64), dict(rope_parameters=dict(rope_type="linear", factor=4.0)), True),
    "deepseek_v3_yarn_rope_parameters_only": (
        "deepseek_v3", MLA, dict(MLA_CONFIG, q_lora_rank=64, n_group=2, topk_group=1, rope_parameters=YARN), True),
}


@pytest.mark.parametrize("name", list(IGNORED_BY_MLX_LM))
def test_follows_mlx_lm_where_it_ignores_a_config_key(name, tmp_path):
    model_type, tiny_args, overrides, drop_rope_scaling = IGNORED_BY_MLX_LM[name]
    hf_dir = synth.tiny(model_type, tmp_path / "hf", overrides=overrides, **tiny_args)
    if drop_rope_scaling:  # as transformers 5 writes it: the scaling only in rope_parameters
        config = json.loads((hf_dir / "config.json").read_text())
        assert config.pop("rope_scaling") and config["rope_parameters"]["rope_type"] != "default"
        (hf_dir / "config.json").write_text(json.dumps(config))
    convert(str(hf_dir), str(tmp_path / "mlx"), quantize=True, q_bits=4, q_group_size=64)
    tokens = np.random.default_rng(3).integers(0, 512, SEQ).astype(np.int32)
    ref_model, _ = load_model(tmp_path / "mlx")
    ref = np.array(ref_model(mx.array(tokens)[None])[0].astype(mx.float32))
    config = json.loads((tmp_path / "mlx" / "config.json").read_text())
    dense, experts = _split_mlx_lm(_load(tmp_path / "mlx"))
    q = config["quantization"]
    model = build_model(config, dense, q, "auto")
    ours = np.array(model(mx.array(tokens), model.make_cache(), ResidentExperts(experts, q["bits"], q["group_size"])))
    _assert_close(ours, ref, 1e-3, name)
