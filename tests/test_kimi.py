"""Kimi Linear and Kimi K3 against mlx-lm, bit for bit on the CPU.

No Hugging Face class exists for Kimi K3 (transformers' Kimi Linear is checked against mlx-lm
on deltafin-synth's checkpoint in test_synth): each tiny checkpoint here is built by mlx-lm's own
model class (random weights, norms and biases perturbed so a wrong one
shows), cast to bfloat16 and quantized by mlx-lm's quantize_model (4-bit, its 8-bit routers),
saved as `mlx_lm convert -q` saves one, then converted to a store by deltafin-convert. Four
layers: KDA (linear attention with a recurrent state and a short convolution) in layers 0 and 2,
MLA in 1 and 3, a dense first layer, then routed experts (Kimi K3's in a latent space, SiTU) with
a shared expert, grouped routing, and Kimi K3's attention residuals in blocks of two layers."""
from __future__ import annotations

import importlib
import json
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from deltafin.client import Client
from deltafin.runtime.config import Config
from deltafin.runtime.store import Store
from deltafin.tools import convert, synth
from deltafin.tools.run import running_supervisor
from conftest import batched_equals_alone, greedy_alone, mlx_lm_greedy  # noqa: E402

pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load_model, quantize_model  # noqa: E402

LINEAR = dict(num_heads=2, head_dim=64, short_conv_kernel_size=4, kda_layers=[1, 3])
COMMON = dict(vocab_size=320, hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
              intermediate_size=128, rms_norm_eps=1e-5, kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=32,
              v_head_dim=64, mla_use_nope=True, num_experts=8, num_experts_per_token=2, num_shared_experts=1,
              moe_intermediate_size=64, first_k_dense_replace=1, num_expert_group=2, topk_group=1,
              routed_scaling_factor=2.5, tie_word_embeddings=False)
CONFIGS = {
    "kimi_k3": dict(COMMON, model_type="kimi_k3", linear_attn_config=dict(LINEAR, gate_lower_bound=-5.0),
                    hidden_act="situ", activation_situ_beta=1.5, activation_situ_linear_beta=4.0,
                    attn_res_block_size=2, q_lora_rank=64, mla_use_output_gate=True, routed_expert_hidden_size=64,
                    latent_moe_use_norm=True),
    "kimi_linear": dict(COMMON, model_type="kimi_linear", linear_attn_config=LINEAR, head_dim=64,
                        rope_theta=10000.0, model_max_length=4096),
}
PROMPT = [(7 * i + 3) % 300 + 3 for i in range(12)]


def mlx_lm_checkpoint(config: dict, out: Path, seed: int = 0) -> Path:
    """A random bfloat16 model of mlx-lm's class for config, quantized and saved by mlx-lm."""
    from mlx.utils import tree_flatten, tree_unflatten
    family = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = family.Model(family.ModelArgs.from_dict(config))
    keep = model.cast_predicate
    params = []
    for i, (name, v) in enumerate(tree_flatten(model.parameters())):
        key = mx.random.key(seed * 1000 + i)
        if name.endswith("norm.weight"):
            v = v * (1 + 0.2 * mx.random.normal(v.shape, key=key))
        elif name.endswith(("dt_bias", "e_score_correction_bias")):
            v = v + 0.3 * mx.random.normal(v.shape, key=key)
        params.append((name, v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) and keep(name) else v))
    model.update(tree_unflatten(params))
    model, quantized = quantize_model(model, dict(config), 64, 4)
    out.mkdir(parents=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(quantized, indent=1))
    synth.write_tokenizer(out, config["vocab_size"])
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def kimi(request, tmp_path_factory):
    """(arch, mlx-lm checkpoint, store converted from it)."""
    root = tmp_path_factory.mktemp(request.param)
    ckpt = mlx_lm_checkpoint(CONFIGS[request.param], root / "q4")
    assert convert.main([str(ckpt), str(root / "store"), "--no-progress"]) == 0
    return request.param, ckpt, root / "store"


def _compute(store: Store, n_slots: int, **compute):
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute
    cfg = Config().to_dict()
    cfg["compute"].update(compute)
    src, staging, loader = local_router(store, cfg, n_slots=n_slots)
    c = Compute(store, cfg, src, staging, store.max_record_bytes)
    if n_slots == len(store.records):
        c.preload()
    return c, loader


def _budgets(store: Store) -> dict:
    """Resident slots: every expert, a quarter of them, the minimum (top_k)."""
    n = len(store.records)
    return {"all": n, "25%": n // 4, "minimum": store.top_k}


def _mlx_lm_chunks(model, ids, chunk):
    cache = make_prompt_cache(model)
    return np.concatenate([np.array(model(mx.array(ids[i:i + chunk])[None], cache=cache)[0].astype(mx.float32))
                           for i in range(0, len(ids), chunk)])


def test_the_store_keeps_the_text_model_and_its_experts(kimi):
    arch, ckpt, path = kimi
    store = Store(path)
    assert store.manifest["architecture"] == arch and store.moe_layers == [1, 2, 3] and store.top_k == 2
    quant = store.layout(1)["quant"]
    assert quant.get("activation") == ({"name": "situ", "beta": 1.5, "linear_beta": 4.0} if arch == "kimi_k3" else None)
    dq = store.manifest["dense_quantization"]
    assert dq["model.layers.1.mlp.gate"] == {"group_size": 64, "bits": 8}  # mlx-lm's 8-bit router
    dense = store.dense_weights()
    assert "model.embed_tokens.weight" in dense and not any(k.startswith("language_model.") for k in dense)
    width = 64 if arch == "kimi_k3" else 128  # Kimi K3's experts live in the latent width
    gate = next(t for t in store.layout(1)["tensors"] if t["name"] == "gate_proj.weight")
    assert gate["shape"] == [64, width * 4 // 32]


def test_logits_are_mlx_lm_s_bit_for_bit_at_every_budget(kimi):
    """Teacher-forced logits of the prompt, in one pass and in chunks of 5 (the recurrent state and
    convolution inputs carried from chunk to chunk), with every expert resident, a quarter and the
    minimum: each equals mlx-lm's, bitwise."""
    arch, ckpt, path = kimi
    ref_model, _ = load_model(ckpt)
    whole = np.array(ref_model(mx.array(PROMPT)[None])[0].astype(mx.float32))
    chunked = _mlx_lm_chunks(ref_model, PROMPT, 5)
    store = Store(path)
    for budget, n_slots in _budgets(store).items():
        for chunk, ref in ((128, whole), (5, chunked)):
            c, loader = _compute(store, n_slots, prefill_chunk=chunk)
            try:
                got = c.logits(PROMPT)
            finally:
                loader.close()
            diff = float(np.abs(got - ref).max())
            assert np.array_equal(got, ref), f"{arch}, {budget} resident, chunk {chunk}: differs by {diff:.3e}"
        if n_slots < len(store.records):
            assert c.experts.counters.get("miss_bytes") > 0


def test_decode_steps_are_mlx_lm_s_and_batched_rows_their_own(kimi):
    """Greedy decoding one row a pass equals mlx-lm's passes logit for logit (the prompt but its
    last token in one pass, then token by token); three sequences of different lengths decoded
    together (their KDA state rows stacked into one step) give each row what it gives alone."""
    arch, ckpt, path = kimi
    ref_model, _ = load_model(ckpt)
    store = Store(path)
    for n_slots in (len(store.records), len(store.records) // 4):
        c, loader = _compute(store, n_slots)
        try:
            prompts = [PROMPT[:5], PROMPT[3:4], PROMPT]
            alone = [greedy_alone(c, p, 6) for p in prompts]
            cache = make_prompt_cache(ref_model)
            ref_model(mx.array(prompts[0][:-1])[None], cache=cache)
            tok = prompts[0][-1]
            for s in range(6):
                ref = np.array(ref_model(mx.array([[tok]]), cache=cache)[0, -1].astype(mx.float32))
                assert np.array_equal(alone[0][s], ref), (arch, n_slots, s, np.abs(alone[0][s] - ref).max())
                tok = int(np.argmax(ref))
            batched_equals_alone(c, prompts, 6, alone)
        finally:
            loader.close()


def _agrees(got: list, ref: list, eos: int = synth.EOS_ID) -> bool:
    """The runtime stops at EOS, mlx-lm's generate_step does not."""
    return got == ref[:len(got)] and (len(got) == len(ref) or got[-1] == eos)


def test_real_processes_give_mlx_lm_s_greedy_tokens_alone_and_together(kimi):
    """The supervisor with a quarter of the experts resident: greedy tokens equal mlx-lm's; two
    requests decoded together give the tokens each gives alone; a third cancelled mid-stream
    leaves them exact, and every sequence's recurrent state and KV cache are given back."""
    arch, ckpt, path = kimi
    prompts = [PROMPT, PROMPT[2:7]]
    refs = [mlx_lm_greedy(ckpt, p, 24) for p in prompts]
    n_slots = len(Store(path).records) // 4
    with running_supervisor(path, "4GiB", ["--max-slots", str(n_slots)]) as (ep, _):
        with Client(ep, timeout=120) as c:
            alone = [c.generate(p, max_tokens=24).token_ids for p in prompts]
        for got, ref in zip(alone, refs):
            assert _agrees(got, ref), (arch, got, ref)
        together: list = [None, None]

        def run(i):
            with Client(ep, timeout=120) as c:
                together[i] = c.generate(prompts[i], max_tokens=24).token_ids
        with Client(ep, timeout=120) as x:
            sx = x.stream(PROMPT[4:9], max_tokens=400)
            next(sx)
            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            next(sx)
            sx.cancel()
            list(sx)
            for t in threads:
                t.join(timeout=180)
            stats = x.stats()["workers"]["compute"]
    assert together == alone
    assert sx.result.finish_reason == "cancelled"
    assert stats["batch"]["max_rows"] >= 2 and stats["batch"]["kv_used_bytes"] == 0, stats["batch"]


def test_the_kimi_k3_forecast_preset_names_its_assumptions():
    """deltafin-forecast --preset kimi-k3: 92 MoE layers of latent-width experts, top-16, and every
    value not in mlx-lm's defaults or the seed named as an assumption."""
    from deltafin.tools.forecast import Shape
    from deltafin.tools.replay import expert_record_bytes
    shape = Shape.of_preset("kimi-k3")
    c = synth.PRESETS["kimi-k3"]
    assert (shape.n_moe, shape.n_dense, shape.top_k, shape.n_experts) == (92, 1, 16, c["num_experts"])
    assert shape.record_bytes == expert_record_bytes(c["routed_expert_hidden_size"], c["moe_intermediate_size"], 4, 64)
    params = 3 * c["routed_expert_hidden_size"] * c["moe_intermediate_size"]
    assert 2.6e12 < params * shape.n_experts * shape.n_moe < 2.8e12 and 25e9 < params * 16 * shape.n_moe < 32e9
    assert any("num_experts" in a for a in shape.to_dict()["assumptions"])


def test_two_ranks_give_one_host_s_tokens_and_logits(kimi, tmp_path):
    """Experts sharded over two ranks (docs/DISTRIBUTED.md): every rank runs the dense layers,
    so each keeps its own copy of every sequence's recurrent state and KV cache (replicated, as
    the attention that reads them is); the latent-width expert outputs are exchanged. Tokens and
    logits equal the single host's, bitwise."""
    from test_distributed import _single, ranks
    arch, _, store = kimi
    extra = ["--max-slots", "3"]
    with _single(store, extra) as (ep, _):
        with Client(ep, timeout=60) as c:
            want = c.generate(PROMPT, max_tokens=16).token_ids
            want_logits = c.logits(PROMPT)
    with ranks(store, tmp_path, 2, extra) as rs:
        with Client(rs[0][0], timeout=60) as c:
            got = c.generate(PROMPT, max_tokens=16).token_ids
            got_logits = c.logits(PROMPT)
            assert c.stats()["workers"]["compute"]["distributed"]["exchanges"] > 0
    assert got == want and np.array_equal(got_logits, want_logits), arch


def test_a_nested_text_config_and_other_models_weights(kimi, tmp_path):
    """A Kimi K3 checkpoint as a multimodal release ships it: the text model's keys under
    text_config, a vision tower's and a multi-token-prediction layer's tensors beside it (mlx-lm
    reads the one and drops the others). The store has the text model alone, its keys at the top
    level, and gives mlx-lm's logits."""
    import shutil
    arch, ckpt, _ = kimi
    if arch != "kimi_k3":
        pytest.skip("Kimi K3's release layout")
    src = tmp_path / "nested"
    shutil.copytree(ckpt, src)
    flat = json.loads((ckpt / "config.json").read_text())
    text = {k: v for k, v in flat.items() if k != "quantization"}
    (src / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": text,
                                                 "vision_config": {"hidden_size": 8},
                                                 "quantization": flat["quantization"]}))
    weights = mx.load(str(ckpt / "model.safetensors"))
    weights.update({"vision_tower.patch_embed.weight": mx.ones((8, 8)),
                    "language_model.model.mtp.0.proj.weight": mx.ones((8, 8))})
    mx.save_safetensors(str(src / "model.safetensors"), weights, metadata={"format": "mlx"})
    assert convert.main([str(src), str(tmp_path / "store"), "--no-progress"]) == 0
    store = Store(tmp_path / "store")
    assert store.config["num_hidden_layers"] == 4 and "text_config" not in store.config
    assert not any(k.startswith(("vision", "model.mtp")) for k in store.dense_weights())
    ref_model, _ = load_model(src)
    ref = np.array(ref_model(mx.array(PROMPT)[None])[0].astype(mx.float32))
    c, loader = _compute(store, len(store.records))
    try:
        assert np.array_equal(c.logits(PROMPT), ref)
    finally:
        loader.close()


def test_the_export_gives_mlx_lm_the_same_model(kimi, tmp_path):
    """deltafin-export-mlx of the store loads in mlx-lm (strict) with the logits of the checkpoint
    it came from, bitwise (the experts' activation is no projection of the export)."""
    from deltafin.tools.export_mlx import export_mlx
    arch, ckpt, store = kimi
    out = export_mlx(store, tmp_path / "mlx")
    logits = [np.array(load_model(p)[0](mx.array([PROMPT]))[0].astype(mx.float32)) for p in (out, ckpt)]
    assert np.array_equal(*logits), arch
