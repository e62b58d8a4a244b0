"""deltafin-synth: tiny HF checkpoints load cleanly in transformers and mlx-lm; bench stores read back."""
from __future__ import annotations

import importlib.util
import json
import shutil

import numpy as np
import pytest

from deltafin.runtime import archinfo
from deltafin.tools import synth

TEXT = "Hello, world! Once upon a time there was a small model."


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    made = {}

    def get(arch, **kw):
        key = (arch, json.dumps(kw, sort_keys=True))
        if key not in made:
            made[key] = synth.tiny(arch, root / f"{arch}-{len(made)}", **kw)
        return made[key]
    return get


CASES = [(a, {}) for a in synth.TINY_ARCHS] + [("deepseek_v2", {"q_lora_rank": 64})]
IDS = [a + ("-qlora" if kw else "") for a, kw in CASES]


def _st_keys(directory):
    from safetensors import safe_open
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "np") as h:
            for k in h.keys():
                out[k] = tuple(h.get_slice(k).get_shape())
    return out


def _hf_logits(path, ids):
    import torch
    from transformers import AutoModelForCausalLM
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info  # missing, unexpected, mismatched, error_msgs
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _mlx_logits(path):
    import mlx.core as mx
    from mlx_lm.utils import load
    model, tok = load(str(synth.for_mlx_lm(path)))  # strict: raises on missing or unexpected weights
    ids = tok.encode(TEXT)
    return ids, np.array(model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("arch,kw", CASES, ids=IDS)
def test_keys_match_transformers(arch, kw, tiny_dir, tmp_path):
    _check_keys_against_transformers(tiny_dir(arch, **kw), tmp_path)


def _transformers_has(path):
    """transformers (skipping without it, or without a class of this model_type: Kimi K3)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    if model_type not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers has no {model_type} class")
    return transformers


def _check_keys_against_transformers(path, tmp_path):
    transformers = _transformers_has(path)
    # transformers writing the same config itself is the ground truth for names and shapes, up to
    # the names the converter maps onto one another (archinfo.store_name: transformers saves
    # Kimi Linear's dense layers under block_sparse_moe, mlx-lm loads them from mlp)
    cfg = transformers.AutoConfig.from_pretrained(path)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "ref")
    config = json.loads((path / "config.json").read_text())
    info = archinfo.arch_for(archinfo.text_model(config))

    def named(keys):
        return {archinfo.store_name(info, k): shape for k, shape in keys.items()}
    # Qwen3.5-MoE's published layout (text_config, model.language_model.*, fused experts) is not
    # what its ForCausalLM writes (flat, per expert): that flat layout is checked here, the
    # published one by mlx-lm loading it strictly (test_loads_in_mlx_lm_and_transformers_alike)
    flat = archinfo.text_model(config)
    assert named(_st_keys(path) if flat is config else synth.tensor_shapes(flat)) == named(_st_keys(tmp_path / "ref"))
    assert synth.tensor_shapes(config) == _st_keys(path)


@pytest.mark.parametrize("arch,kw", CASES, ids=IDS)
def test_loads_in_mlx_lm_and_transformers_alike(arch, kw, tiny_dir):
    pytest.importorskip("mlx_lm")
    path = tiny_dir(arch, **kw)
    _transformers_has(path)
    ids, mlx_out = _mlx_logits(path)
    hf_out = _hf_logits(path, ids)
    # both libraries read the config the same way (rope, yarn, routing, scaling, norms)
    np.testing.assert_allclose(mlx_out, hf_out, atol=2e-4, rtol=0)
    assert hf_out.std() > 0.3  # unit-scale init: logits are not flat


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
# config overrides that change tensor names or shapes (the first ones also load in mlx-lm)
OVERRIDES = [
    ("qwen3_moe", {"tie_word_embeddings": True, "mlp_only_layers": [0], "head_dim": 64}),
    ("qwen2_moe", {"shared_expert_intermediate_size": 64, "num_key_value_heads": 4}),
    ("deepseek_v2", {"q_lora_rank": 64, "n_shared_experts": 1, "kv_lora_rank": 128, "qk_nope_head_dim": 32,
                     "v_head_dim": 32, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1,
                     "rope_parameters": YARN}),
    ("deepseek_v3", {"q_lora_rank": None, "first_k_dense_replace": 2, "n_group": 2, "topk_group": 1,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
]
BIAS_OVERRIDES = [  # transformers reads these; mlx-lm hard-codes some of them
    ("qwen2_moe", {"qkv_bias": False}), ("qwen3_moe", {"attention_bias": True}),
    ("olmoe", {"attention_bias": True}), ("deepseek_v3", {"attention_bias": True}),
]
OVERRIDE_IDS = [f"{a}-{'-'.join(kw)}"[:60] for a, kw in OVERRIDES + BIAS_OVERRIDES]


@pytest.mark.parametrize("arch,overrides", OVERRIDES + BIAS_OVERRIDES, ids=OVERRIDE_IDS)
def test_overrides_keys_match_transformers(arch, overrides, tiny_dir, tmp_path):
    _check_keys_against_transformers(tiny_dir(arch, overrides=overrides), tmp_path)


@pytest.mark.parametrize("arch,overrides", OVERRIDES, ids=OVERRIDE_IDS[:len(OVERRIDES)])
def test_overrides_load_in_mlx_lm(arch, overrides, tiny_dir):
    pytest.importorskip("mlx_lm")
    path = tiny_dir(arch, overrides=overrides)
    c = json.loads((path / "config.json").read_text())
    assert {k: c[k] for k in overrides if k != "rope_parameters"} == {
        k: v for k, v in overrides.items() if k != "rope_parameters"}
    assert synth.tensor_shapes(c) == _st_keys(path)
    _, logits = _mlx_logits(path)  # strict: every tensor mlx-lm expects, and no other
    assert np.isfinite(logits).all() and logits.std() > 0.3


def test_overrides_keep_both_spellings_in_step(tiny_dir):
    c = json.loads((tiny_dir("deepseek_v2", overrides={"rope_parameters": YARN}) / "config.json").read_text())
    assert c["rope_parameters"] == YARN and c["rope_theta"] == 10000.0
    assert c["rope_scaling"] == {"type": "yarn", **{k: v for k, v in YARN.items()
                                                    if k not in ("rope_type", "rope_theta")}}
    hub = synth.hub_config("deepseek_v3", layers=3, experts=8, top_k=2, hidden=128, moe_intermediate=128,
                           vocab=512)
    plain = synth.with_overrides(hub, {"rope_parameters": {"rope_type": "default"}})
    assert "rope_scaling" not in plain and plain["rope_parameters"] == {"rope_type": "default",
                                                                        "rope_theta": hub["rope_theta"]}
    old = synth.with_overrides(hub, {"rope_theta": 5e4, "rope_scaling": None})
    assert old["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e4}
    qwen = synth.hub_config("qwen3_moe", layers=2, experts=8, top_k=2, hidden=128, moe_intermediate=128,
                            vocab=512)
    qwen = synth.with_overrides(qwen, {"num_experts": 4, "num_hidden_layers": 3})
    assert qwen["num_local_experts"] == 4 and qwen["max_window_layers"] == 3
    assert synth.with_overrides(hub, None) == hub
    with pytest.raises(ValueError, match="dtype="):
        synth.with_overrides(hub, {"dtype": "bfloat16"})


def test_cli_set(tmp_path, capsys):
    out = tmp_path / "q"
    assert synth.main(["tiny", "qwen3_moe", str(out), "--set", "tie_word_embeddings=true",
                       "--set", "mlp_only_layers=[0]", "--set", 'rope_parameters={"rope_type": "default"}']) == 0
    c = json.loads((out / "config.json").read_text())
    assert c["tie_word_embeddings"] is True and c["mlp_only_layers"] == [0]
    assert c["rope_parameters"] == {"rope_type": "default", "rope_theta": c["rope_theta"]}
    keys = _st_keys(out)
    assert "lm_head.weight" not in keys and "model.layers.0.mlp.gate_proj.weight" in keys
    for bad, why in (("n_group", "expected KEY=JSON"), ("n_group=two", "value is not JSON")):
        with pytest.raises(SystemExit):
            synth.main(["tiny", "qwen3_moe", str(out), "--set", bad])
        assert why in capsys.readouterr().err


@pytest.mark.parametrize("arch", synth.TINY_ARCHS)
def test_config_is_hub_style(arch):
    c = synth.hub_config(arch, layers=3, experts=8, top_k=2, hidden=128, moe_intermediate=128, vocab=512)
    for key in ("model_type", "architectures", "torch_dtype", "dtype", "rope_theta", "rope_parameters"):
        assert key in c
    assert c[archinfo.arch_for(c).experts_key] == 8
    # every matrix fits 4-bit group-64 quantization (input width multiple of 64)
    for name, shape in synth.tensor_shapes(c).items():
        if len(shape) == 2:
            assert shape[1] % 64 == 0, name
    info, shapes = archinfo.arch_for(c), synth.tensor_shapes(c)
    experts = [n for n in shapes if archinfo.expert_pattern(info).match(archinfo.store_name(info, n))]
    fused_layers = {int(m[1]) for n in shapes if (m := archinfo.fused_pattern(info).match(n))}  # gpt-oss
    assert len(experts) + 3 * 8 * len(fused_layers) == 3 * 8 * len(archinfo.moe_layers(c))


def test_routing_is_not_degenerate(tiny_dir):
    # every expert of the tiny models gets used on ordinary text
    path = tiny_dir("qwen3_moe")
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(TEXT * 3).ids
    from safetensors.numpy import load_file
    w = load_file(str(path / "model.safetensors"))
    x = w["model.embed_tokens.weight"][ids]
    x = x / np.sqrt((x * x).mean(-1, keepdims=True))
    top = np.argsort(-(x @ w["model.layers.0.mlp.gate.weight"].T), -1)[:, :2]
    assert len(np.unique(top)) == 8


def test_shards_and_index(tiny_dir, tmp_path):
    single = tiny_dir("mixtral")
    out = tmp_path / "sharded"
    assert synth.main(["tiny", "mixtral", str(out), "--shards", "3"]) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (out / "model.safetensors").exists()
    from safetensors.numpy import load_file
    merged = {}
    for f in files:
        part = load_file(str(out / f))
        assert set(part) == {k for k, v in index["weight_map"].items() if v == f}
        merged.update(part)
    ref = load_file(str(single / "model.safetensors"))
    assert set(merged) == set(ref)
    assert all(np.array_equal(merged[k], ref[k]) for k in ref)  # same seed, same values
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in ref.values())
    if importlib.util.find_spec("mlx_lm"):
        _mlx_logits(out)
    if importlib.util.find_spec("transformers") and importlib.util.find_spec("torch"):
        ids = list(range(10))
        np.testing.assert_allclose(_hf_logits(out, ids), _hf_logits(single, ids), atol=1e-6)


def test_bfloat16_checkpoint(tiny_dir):
    pytest.importorskip("mlx_lm")
    path = tiny_dir("deepseek_v3", dtype="bfloat16")
    header_len = int.from_bytes((path / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((path / "model.safetensors").read_bytes()[8:8 + header_len])
    assert header["model.embed_tokens.weight"]["dtype"] == "BF16"
    assert header["model.layers.1.mlp.gate.e_score_correction_bias"]["dtype"] == "F32"
    import mlx.core as mx
    from mlx_lm.utils import load
    model, _ = load(str(path))
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    model.set_dtype(mx.float32)  # mlx's CPU gather_mm is float32-only
    assert bool(mx.all(mx.isfinite(model(mx.array([[1, 2, 3]])))))
    x = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    assert np.array_equal(synth.to_bf16_bits(x), np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16)))


def test_tokenizer(tiny_dir):
    from tokenizers import Tokenizer
    path = tiny_dir("olmoe")
    cfg = json.loads((path / "config.json").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tok.get_vocab_size() == cfg["vocab_size"]
    assert tok.decode(tok.encode(TEXT).ids) == TEXT
    assert tok.token_to_id("<|im_end|>") == cfg["eos_token_id"]
    assert tok.token_to_id("<|endoftext|>") == cfg["bos_token_id"]
    import jinja2
    tc = json.loads((path / "tokenizer_config.json").read_text())
    text = jinja2.Template(tc["chat_template"]).render(
        messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bench_store_reads_back(tmp_path):
    store_mod = pytest.importorskip("deltafin.runtime.store")
    out = tmp_path / "dsv2"
    try:
        assert synth.main(["bench", "dsv2-lite", str(out), "--layers", "2"]) == 0
        s = store_mod.Store(out)
        assert s.moe_layers == [1] and s.n_experts == 64 and s.top_k == 6
        assert (s.bits, s.group_size) == (4, 64)
        assert len(s.records) == 64
        rec = s.read_expert(1, 63)
        assert rec["gate_proj.weight"].shape == (1408, 2048 * 4 // 32)
        assert rec["down_proj.weight"].shape == (2048, 1408 * 4 // 32)
        assert rec["down_proj.scales"].shape == (2048, 1408 // 64)
        assert not np.array_equal(rec["up_proj.weight"], s.read_expert(1, 0)["up_proj.weight"])
        assert list(s.verify()) == []
        dense = s.dense_weights()
        assert dense["model.embed_tokens.weight"].shape == (102400, 256)  # quantized mlx-style
        assert "model.layers.1.mlp.shared_experts.down_proj.scales" in dense
        assert "model.layers.1.mlp.gate.weight" in dense and "model.layers.0.mlp.up_proj.biases" in dense
        assert not any(".experts." in k for k in dense)
        assert s.config["num_hidden_layers"] == 2
        assert (s.tokenizer_dir / "tokenizer.json").exists()
    finally:
        shutil.rmtree(out, ignore_errors=True)  # ~600 MB: do not leave it in pytest's tmp


def _mlx_from_store(path):
    """Loads a store into mlx-lm's own model class (experts stacked): proves the store is complete."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes
    from deltafin.runtime.store import Store
    s = Store(path)
    w = s.dense_weights()
    for layer in s.moe_layers:
        recs = [s.read_expert(layer, e) for e in range(s.n_experts)]
        for name in recs[0]:
            a = mx.array(np.stack([r[name] for r in recs]))
            if a.dtype == mx.uint16:
                a = a.view(mx.bfloat16)
            w[f"model.layers.{layer}.mlp.switch_mlp.{name}"] = a
    model_cls, args_cls = _get_classes(s.config)
    model = model_cls(args_cls.from_dict(s.config))
    q = s.manifest["dense_quantization"]
    nn.quantize(model, group_size=q["group_size"], bits=q["bits"],
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in w)
    model.load_weights(list(model.sanitize(w).items()), strict=True)
    model.set_dtype(mx.float32)  # mlx's CPU quantized matmul is many times slower in bf16/fp16
    return model(mx.array([[1, 5, 9, 200]]))


@pytest.mark.parametrize("preset", ["kimi-k2", "qwen3-30b-a3b"])
def test_bench_store_runs_in_mlx_lm(preset, tmp_path, monkeypatch):
    pytest.importorskip("mlx_lm")
    # the preset's structure (every tensor name) at a size a CPU test can afford
    small = dict(synth.PRESETS[preset], vocab_size=1024, hidden_size=1024, intermediate_size=1024,
                 moe_intermediate_size=256, num_attention_heads=8, num_key_value_heads=4)
    small.update({k: 16 for k in ("n_routed_experts", "num_experts", "num_local_experts") if k in small})
    if small.get("q_lora_rank"):
        small["q_lora_rank"] = 256
    monkeypatch.setitem(synth.PRESETS, preset, small)
    synth.bench(preset, tmp_path / "s", layers=2, progress=False)
    import mlx.core as mx
    logits = _mlx_from_store(tmp_path / "s").astype(mx.float32)
    assert bool(mx.all(mx.isfinite(logits))) and mx.std(logits).item() > 0.3


def test_hf_init_draws_as_transformers_does(tmp_path):
    """--init hf: every weight normal with the config's initializer_range (0.02), biases zero,
    norms one, where the default scales each matrix by its fan-in and embeddings by 1."""
    from safetensors.numpy import load_file
    unit = load_file(synth.tiny("qwen2_moe", tmp_path / "unit", hidden=256) / "model.safetensors")
    hf = load_file(synth.tiny("qwen2_moe", tmp_path / "hf", hidden=256, init="hf") / "model.safetensors")
    assert set(unit) == set(hf)
    for name, a in hf.items():
        if name.endswith("norm.weight"):
            assert (a == 1).all(), name
        elif name.endswith("bias"):
            assert (a == 0).all(), name
        elif a.size >= 4096:
            assert abs(float(a.std()) - 0.02) < 0.002, (name, float(a.std()))
    assert abs(float(unit["model.embed_tokens.weight"].std()) - 1.0) < 0.05
    assert "model.layers.0.self_attn.q_proj.bias" in hf
