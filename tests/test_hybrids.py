"""The hybrid families (Qwen3-Next, Qwen3.5/3.6 MoE): Gated DeltaNet linear layers with a
recurrent state beside gated softmax attention, against mlx-lm 0.32.2.

Each case is a tiny random checkpoint written by transformers (torch), in the layout the real
models ship: Qwen3-Next's per-expert tensors; Qwen3.5-MoE's multimodal wrapper (text_config,
model.language_model.*) with fused experts (experts.gate_up_proj / down_proj). mlx_lm.convert
quantizes it (4-bit, 8-bit routers and shared-expert gates), deltafin-convert makes stores of both
the quantized and the float checkpoint. Config fixes mlx-lm needs to load transformers-5 output,
made in the fixture: Qwen3-Next's rope_theta and partial_rotary_factor copied to the top level
from rope_parameters and full_attention_interval written (transformers 5 keeps only layer_types);
Qwen3.5-MoE is rewritten from Qwen3_5MoeForCausalLM's flat layout into the nested one above,
which is what mlx-lm's qwen3_5_moe reads."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from deltafin.runtime import archinfo  # noqa: E402
from deltafin.runtime.config import Config, load_config  # noqa: E402
from deltafin.runtime.layerkinds import FullKV, RecurrentState  # noqa: E402
from deltafin.runtime.store import Store  # noqa: E402
from deltafin.tools import convert  # noqa: E402
from deltafin.tools.inprocess import local_router  # noqa: E402
from deltafin.tools.synth import write_tokenizer  # noqa: E402
from deltafin.workers.engine import Compute  # noqa: E402
from conftest import batched_equals_alone, config_flags  # noqa: E402

INTERVAL = 2  # layers 0 and 2 linear, 1 and 3 full attention
TINY = dict(vocab_size=384, hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
            layer_types=["linear_attention", "full_attention"] * 2, tie_word_embeddings=False)
TOKENS = [(37 * i + 11) % 380 + 3 for i in range(13)]
FAMILIES = ("qwen3_next", "qwen3_5_moe")


@dataclass
class Case:
    family: str
    hf: Path     # float checkpoint, the real Hugging Face layout
    mlx: Path    # mlx-lm quantized checkpoint
    store: Path  # deltafin-convert of mlx
    hf_store: Path  # deltafin-convert of hf


def _edit_weights(path: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file
    weights = edit(load_file(str(path)))
    save_file(weights, str(path), metadata={"format": "pt"})


def _randomize_norms(weights: dict) -> dict:
    # Non-trivial norms (transformers starts the zero-centred ones at 0), so a missing 1 + w shows.
    rng = np.random.default_rng(1)
    return {k: (w + 0.2 * rng.standard_normal(w.shape)).astype(w.dtype) if "norm" in k else w
            for k, w in weights.items()}


def _nest_qwen3_5(weights: dict) -> dict:
    """Qwen3_5MoeForCausalLM's tensors in Qwen3.5-MoE's published layout: model.language_model.*,
    each layer's experts fused into gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""
    out, experts = {}, {}
    for k, w in weights.items():
        parts = k.split(".")
        if ".mlp.experts." in k:
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = w
            continue
        out[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = w
    for layer in sorted({layer for layer, _ in experts}):
        stack = {p: np.stack([experts[(layer, p)][e] for e in sorted(experts[(layer, p)])])
                 for p in ("gate_proj", "up_proj", "down_proj")}
        prefix = f"model.language_model.layers.{layer}.mlp.experts"
        out[f"{prefix}.gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]], axis=1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
    return out


def _hf_checkpoint(family: str, out: Path) -> Path:
    torch.manual_seed(0)
    if family == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**TINY, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        transformers.Qwen3NextForCausalLM(cfg).save_pretrained(out)
        _edit_weights(out / "model.safetensors", _randomize_norms)
        config = json.loads((out / "config.json").read_text())
        rope = config["rope_parameters"]
        config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                      full_attention_interval=INTERVAL)
    else:
        cfg = transformers.Qwen3_5MoeTextConfig(**TINY)
        transformers.Qwen3_5MoeForCausalLM(cfg).save_pretrained(out)
        _edit_weights(out / "model.safetensors", lambda w: _nest_qwen3_5(_randomize_norms(w)))
        text = json.loads((out / "config.json").read_text())
        text["full_attention_interval"] = INTERVAL
        config = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
                  "text_config": text, "tie_word_embeddings": False}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out, TINY["vocab_size"])
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def case(request, tmp_path_factory) -> Case:
    from mlx_lm import convert as mlx_convert
    root = tmp_path_factory.mktemp(request.param)
    hf = _hf_checkpoint(request.param, root / "hf")
    mlx_convert(str(hf), str(root / "mlx"), quantize=True, q_bits=4, q_group_size=64, dtype="bfloat16")
    for src, out in ((root / "mlx", root / "store"), (hf, root / "hf-store")):
        assert convert.main([str(src), str(out), "--no-progress"]) == 0
    return Case(request.param, hf, root / "mlx", root / "store", root / "hf-store")


def _mlx_lm_logits(ckpt: Path, tokens: list) -> np.ndarray:
    from mlx_lm.utils import load_model
    model, _ = load_model(ckpt)
    return np.array(model(mx.array(tokens)[None])[0].astype(mx.float32))


def _compute(store: Store, n_slots: int, **compute):
    cfg = Config().to_dict()
    cfg["compute"]["dtype"] = "auto"  # the checkpoint's own dtype, as mlx-lm runs it
    cfg["compute"].update(compute)
    src, staging, loader = local_router(store, cfg, n_slots=n_slots)
    c = Compute(store, cfg, src, staging, store.max_record_bytes)
    if not n_slots:
        c.preload()
    return c, loader


# ---------------------------------------------------------------- registry and store

def test_the_registry_gives_linear_layers_a_recurrent_state(case):
    store = Store(case.store)
    kinds = archinfo.layer_caches(store.config)
    assert [type(k) for k in kinds] == [RecurrentState, FullKV] * 2
    # state [value heads, value dim, key dim] in float32, conv: kernel - 1 rows of q, k and v
    assert kinds[0] == RecurrentState((4, 32, 32), (3, 2 * 2 * 32 + 4 * 32), 4)
    assert store.manifest["model"]["moe_layers"] == [0, 1, 2, 3]
    dense = store.dense_weights()
    assert all(k.startswith(("model.layers.", "model.embed_tokens", "model.norm", "lm_head")) for k in dense)
    q = store.manifest["dense_quantization"]
    assert q["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}  # mlx-lm's 8-bit router
    assert q["model.layers.0.mlp.shared_expert_gate"] == {"group_size": 64, "bits": 8}


# ---------------------------------------------------------------- exact against mlx-lm

@pytest.mark.parametrize("share", [1.0, 0.25, "minimum"])
def test_teacher_forced_logits_equal_mlx_lm_bitwise_at_every_budget(case, share):
    """mlx-lm on its quantized checkpoint against deltafin on the store converted from it: all
    experts resident, a quarter of them streamed, the minimum (top_k slots); prefilled in chunks
    of 5 (the recurrent and convolution states carried across chunks)."""
    ref = _mlx_lm_logits(case.mlx, TOKENS)
    store = Store(case.store)
    n_slots = {1.0: 0, 0.25: len(store.records) // 4, "minimum": store.top_k}[share]
    c, loader = _compute(store, n_slots, prefill_chunk=5)
    try:
        ours = c.logits(TOKENS)
    finally:
        loader.close()
    assert c.model.dtype == mx.bfloat16
    assert np.array_equal(ours, ref), f"{case.family} at {share}: max|diff| {np.abs(ours - ref).max()}"


def test_the_float_checkpoint_matches_mlx_lm_on_it_bitwise(case):
    """The Hugging Face layout (centred norms, conv1d [channels, 1, kernel], per-expert or fused
    experts) converted by deltafin-convert, which quantizes the experts alone (4-bit, group 64),
    against mlx-lm on the float checkpoint with its experts quantized the same way."""
    import mlx.nn as nn
    from mlx_lm.utils import load_model
    model, _ = load_model(case.hf)
    nn.quantize(model, 64, 4, class_predicate=lambda path, _: path.endswith(tuple(
        f"switch_mlp.{p}" for p in archinfo.PROJS)))
    ref = np.array(model(mx.array(TOKENS)[None])[0].astype(mx.float32))
    c, loader = _compute(Store(case.hf_store), 0)
    try:
        ours = c.logits(TOKENS)
    finally:
        loader.close()
    assert c.model.dtype == mx.float32
    assert np.array_equal(ours, ref), f"{case.family}: max|diff| {np.abs(ours - ref).max()}"


@pytest.mark.skipif(not mx.metal.is_available(), reason="mlx-lm's Gated DeltaNet kernel is Metal's")
def test_on_an_apple_gpu_the_recurrence_is_mlx_lms_kernel():
    from mlx_lm.models.gated_delta import gated_delta_kernel

    from deltafin.runtime.models.gated_delta import metal_kernel
    assert metal_kernel(128) is gated_delta_kernel and metal_kernel(16) is None


def test_greedy_tokens_equal_mlx_lm_generate(case):
    from deltafin.tools.mmap_baseline import run_inprocess
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model
    model, _ = load_model(case.mlx)
    ref = [int(t) for t, _ in generate_step(mx.array(TOKENS), model, max_tokens=24)]
    cfg = load_config(None, {"compute.dtype": "auto"}).to_dict()
    assert run_inprocess(case.store, cfg, TOKENS, 24, source="slots")["token_ids"] == ref


def test_a_batched_step_gives_each_row_what_its_sequence_gives_alone(case):
    """Sequences of different lengths decoded together: the linear layers step their stacked
    state rows at once, the attention layers their own caches; each row bitwise its own."""
    store = Store(case.store)
    c, loader = _compute(store, len(store.records) // 2)
    try:
        steps = 4
        caches = batched_equals_alone(c, [TOKENS[:1], TOKENS[:4], TOKENS[3:9]], steps)
        assert caches[0][0].offset == steps and caches[0][0].state.dtype == mx.float32
        # what the budget and admission charge a linear layer (bfloat16 model) is what it holds
        assert all(cache[0].nbytes == c.model.layer_kinds[0].nbytes(1, 2) for cache in caches)
    finally:
        loader.close()


def test_the_export_of_the_store_loads_in_mlx_lm_with_its_logits(case, tmp_path):
    """deltafin-export-mlx of the store converted from mlx-lm's checkpoint: mlx-lm loads it (under
    the language model's names) and gives the logits it gives on its own checkpoint, bit for bit.
    A qwen3_next store of the float checkpoint is refused with the reason."""
    from deltafin.tools.export_mlx import ExportError, export_mlx
    out = export_mlx(case.store, tmp_path / "mlx")
    assert np.array_equal(_mlx_lm_logits(out, TOKENS), _mlx_lm_logits(case.mlx, TOKENS))
    if case.family == "qwen3_next":
        with pytest.raises(ExportError, match="Hugging Face checkpoint's linear layers"):
            export_mlx(case.hf_store, tmp_path / "hf-mlx")


def test_qwen3_next_with_dense_layers_and_tied_embeddings(tmp_path):
    """mlp_only_layers (a dense SwiGLU layer among the MoE ones) and a tied head, from
    deltafin-synth's checkpoint through mlx_lm.convert: logits bitwise mlx-lm's."""
    from mlx_lm import convert as mlx_convert

    from deltafin.tools.synth import tiny
    src = tiny("qwen3_next", tmp_path / "hf", layers=4, dtype="bfloat16",
               overrides={"mlp_only_layers": [0], "tie_word_embeddings": True})
    mlx_convert(str(src), str(tmp_path / "q4"), quantize=True, q_bits=4, q_group_size=64)
    assert convert.main([str(tmp_path / "q4"), str(tmp_path / "store"), "--no-progress"]) == 0
    store = Store(tmp_path / "store")
    assert store.moe_layers == [1, 2, 3]
    c, loader = _compute(store, store.top_k)
    try:
        ours = c.logits(TOKENS)
    finally:
        loader.close()
    assert c.model.head is c.model.embed
    assert np.array_equal(ours, _mlx_lm_logits(tmp_path / "q4", TOKENS))


def test_qwen3_5_moe_routes_every_layer_and_reads_top_level_rope_as_mlx_lm(tmp_path):
    """mlx-lm's Qwen3.5 puts the MoE block on every layer whatever mlp_only_layers and
    decoder_sparse_step say, and reads rope_theta and partial_rotary_factor from the top level
    when rope_parameters is null: logits bitwise mlx-lm's on such a checkpoint."""
    from mlx_lm import convert as mlx_convert

    from deltafin.tools.synth import tiny
    src = tiny("qwen3_5_moe", tmp_path / "hf", layers=4, dtype="bfloat16")
    config = json.loads((src / "config.json").read_text())
    config["text_config"].update(mlp_only_layers=[0], decoder_sparse_step=2, rope_parameters=None,
                                 rope_theta=5000.0, partial_rotary_factor=0.5)
    (src / "config.json").write_text(json.dumps(config))
    mlx_convert(str(src), str(tmp_path / "q4"), quantize=True, q_bits=4, q_group_size=64)
    assert convert.main([str(tmp_path / "q4"), str(tmp_path / "store"), "--no-progress"]) == 0
    store = Store(tmp_path / "store")
    assert store.moe_layers == [0, 1, 2, 3]
    c, loader = _compute(store, store.top_k)
    try:
        ours = c.logits(TOKENS)
    finally:
        loader.close()
    assert np.array_equal(ours, _mlx_lm_logits(tmp_path / "q4", TOKENS))


def test_the_bench_preset_runs_in_deltafin_as_in_mlx_lm(tmp_path, monkeypatch):
    """deltafin-synth bench's Qwen3.5-MoE preset (its structure at widths a CPU test affords, 4
    layers: 3 linear, 1 full): mlx-lm loads the store's export, and deltafin's logits on the
    store are mlx-lm's bit for bit."""
    from deltafin.tools import synth
    from deltafin.tools.export_mlx import export_mlx
    small = dict(synth.PRESETS["qwen3.5-35b-a3b"], vocab_size=1024, hidden_size=512, num_experts=16,
                 moe_intermediate_size=128, shared_expert_intermediate_size=128, head_dim=128,
                 linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)
    monkeypatch.setitem(synth.PRESETS, "qwen3.5-35b-a3b", small)
    store = synth.bench("qwen3.5-35b-a3b", tmp_path / "s", layers=4, progress=False)
    ref = _mlx_lm_logits(export_mlx(store, tmp_path / "mlx"), TOKENS)
    c, loader = _compute(Store(store), 0)
    try:
        ours = c.logits(TOKENS)
    finally:
        loader.close()
    assert [type(k) for k in c.model.layer_kinds] == [RecurrentState] * 3 + [FullKV]
    assert np.isfinite(ref).all() and ref.std() > 0.1 and np.array_equal(ours, ref)


# ---------------------------------------------------------------- real processes

def test_real_processes_give_mlx_lm_greedy_tokens_at_every_budget(case, tmp_path):
    """Supervisor, router, loader and compute: every expert resident, a quarter of them, the
    minimum; prefetch and leases on and off: the greedy tokens are mlx-lm's."""
    from deltafin.client import Client
    from deltafin.tools.run import running_supervisor
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model
    model, _ = load_model(case.mlx)
    ref = [int(t) for t, _ in generate_step(mx.array(TOKENS), model, max_tokens=20)]
    n_keys, top_k = len(Store(case.store).records), Store(case.store).top_k
    runs = [(n_keys, {}), (n_keys // 4, {}), (top_k, {}), (n_keys // 4, {"cache": {"prefetch": False}}),
            (n_keys // 4, {"bench": {"leases": False}})]
    for i, (slots, sections) in enumerate(runs):
        (tmp_path / f"{i}").mkdir()
        flags = config_flags(tmp_path / f"{i}", **sections)
        with running_supervisor(case.store, "4GiB", [*flags, "--max-slots", str(slots)]) as (ep, _):
            with Client(ep, timeout=120) as c:
                got = c.generate(TOKENS, max_tokens=20).token_ids
        assert got == ref, (case.family, slots, sections)


def test_requests_decoded_together_and_one_cancelled_give_their_tokens_alone(case):
    """Two requests decode together (their linear layers step one stacked state) with a third
    that is cancelled two tokens in: each of the two gets its tokens alone, and every cache
    charged to admission goes back."""
    from deltafin.client import Client
    from deltafin.tools.run import running_supervisor
    candidates = [TOKENS[i:i + 2 + i % 5] for i in range(10)]
    with running_supervisor(case.store, "4GiB") as (ep, _):
        with Client(ep, timeout=120) as a, Client(ep, timeout=120) as b, Client(ep, timeout=120) as x:
            # prompts the random model does not end early (EOS) within 30 tokens
            alone = [(p, a.generate(p, max_tokens=30)) for p in candidates]
            prompts, refs = zip(*[(p, g.token_ids) for p, g in alone if g.finish_reason == "length"][:3])
            ref_a, ref_b = refs[:2]
            sa, sx = a.stream(prompts[0], max_tokens=30), x.stream(prompts[2], max_tokens=1000)
            sb = b.stream(prompts[1], max_tokens=30)
            next(sa), next(sb), next(sx)
            next(sx)
            sx.cancel()
            list(sx), list(sa), list(sb)
            batch = a.stats()["workers"]["compute"]["batch"]
    assert sx.result.finish_reason == "cancelled"
    assert sa.result.token_ids == ref_a and sb.result.token_ids == ref_b
    assert batch["max_rows"] >= 2 and batch["kv_used_bytes"] == 0, batch
