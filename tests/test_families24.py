"""GLM-4.5 (glm4_moe), gpt-oss (gpt_oss) and MiniMax-M2 (minimax_m2) against mlx-lm 0.32.2.

Each family's tiny bfloat16 checkpoint (deltafin-synth, the layout transformers writes; gpt-oss's
experts rewritten into mlx-lm's layout for mlx-lm, synth.for_mlx_lm) is quantized by mlx_lm.convert
(4-bit, group 64) and converted by deltafin-convert. Teacher-forced logits through the runtime's
compute (in-process router and loader) equal mlx-lm's bit for bit with every expert resident, a
quarter of them and the minimum (top_k slots); greedy tokens equal mlx-lm's generate_step in
process and, for glm4_moe, through the supervisor and its worker processes; the model decodes
step by step and in chunks as mlx-lm does with its own caches. glm4_moe has a dense first layer
and two expert groups; gpt-oss a sliding layer (window 8, shorter than the prompt), a full one
and its published yarn rope."""
from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest

from deltafin.runtime import archinfo
from deltafin.runtime.config import Config
from deltafin.runtime.store import Store
from deltafin.tools import convert, synth

pytest.importorskip("mlx_lm")
from mlx_lm import convert as mlx_convert  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402
from conftest import mlx_lm_greedy  # noqa: E402

FAMILIES = ("glm4_moe", "gpt_oss", "minimax_m2")
# gpt-oss's published rope: yarn, factor 32 over 4096 positions, theta 150000
OVERRIDES = {"gpt_oss": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                             "beta_slow": 1.0}}}
PROMPT = [(11 * i + 5) % 500 + 3 for i in range(16)]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(mlx-lm quantized checkpoint, its deltafin store, the HF checkpoint) of one family."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    hf = synth.tiny(arch, root / "hf", experts=8, moe_intermediate=64, seed=21, dtype="bfloat16",
                    overrides=OVERRIDES.get(arch))
    mlx_convert(str(synth.for_mlx_lm(hf)), str(root / "q4"), quantize=True, q_bits=4, q_group_size=64)
    assert convert.main([str(root / "q4"), str(root / "store"), "--no-progress"]) == 0
    return root / "q4", Store(root / "store"), hf


def mlx_lm_logits(ckpt, ids) -> np.ndarray:
    model, _ = load_model(ckpt)
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def compute_logits(store: Store, n_slots: int, ids) -> np.ndarray:
    """Teacher-forced logits of the runtime's compute with n_slots resident experts."""
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute
    cfg = Config().to_dict()
    src, staging, loader = local_router(store, cfg, n_slots=n_slots)
    try:
        return Compute(store, cfg, src, staging, store.max_record_bytes).logits(ids)
    finally:
        loader.close()


def test_the_store_keeps_each_family_s_experts(family):
    q4, store, _ = family
    config = store.config
    info = archinfo.arch_for(config)
    assert store.moe_layers == archinfo.moe_layers(config) and store.n_experts == 8
    layout = store.layout(store.moe_layers[0])
    names = {t["name"] for t in layout["tensors"]}
    biased = info.model_type == "gpt_oss"
    assert ({"gate_proj.bias", "up_proj.bias", "down_proj.bias"} <= names) == biased
    assert layout["quant"].get("activation") == info.activation(config)
    if info.model_type == "glm4_moe":
        assert store.moe_layers == [1, 2]  # first_k_dense_replace = 1
    # the record holds mlx-lm's bytes: expert 5 of the last layer, tensor by tensor
    layer = store.moe_layers[-1]
    q = {k: v for f in sorted(q4.glob("model*.safetensors")) for k, v in mx.load(str(f)).items()}
    got = store.read_expert(layer, 5)
    for name in names:
        ref = q[f"model.layers.{layer}.{info.block}.{info.stacked}.{name}"][5]
        ref = np.array(ref.view(mx.uint16) if ref.dtype == mx.bfloat16 else ref)
        np.testing.assert_array_equal(got[name], ref, err_msg=name)


def logits_equal_mlx_lm_at_every_budget(checkpoint, store) -> None:
    """The runtime's teacher-forced logits on `store` equal mlx-lm's on `checkpoint`, bit for bit,
    with every expert resident, a quarter of them and the minimum (top-k)."""
    ref = mlx_lm_logits(checkpoint, PROMPT)
    assert ref.std() > 0.3
    n = len(store.records)
    for n_slots in (n, n // 4, store.top_k):
        np.testing.assert_array_equal(compute_logits(store, n_slots, PROMPT), ref,
                                      err_msg=f"{store.config['model_type']} with {n_slots} of {n} experts resident")


def test_teacher_forced_logits_equal_mlx_lm_at_every_budget(family):
    q4, store, _ = family
    logits_equal_mlx_lm_at_every_budget(q4, store)


def test_float_checkpoint_converts_to_mlx_s_own_quantization(family):
    """The Hugging Face checkpoint (gpt-oss: fused, transposed and interleaved experts with biases)
    converts to the same expert bytes as mlx.quantize of mlx-lm's own reading of it."""
    _, store, hf = family
    info = archinfo.arch_for(store.config)
    out = hf.parent / "from-hf"
    assert convert.main([str(hf), str(out), "--no-progress"]) == 0
    ours = Store(out)
    model, _ = load_model(synth.for_mlx_lm(hf))
    layer = ours.moe_layers[-1]
    experts = getattr(model.model.layers[layer], info.block)
    switch = getattr(experts, info.stacked)
    got = ours.read_expert(layer, 3)
    for proj in archinfo.PROJS:
        module = getattr(switch, proj)
        wq, scales, biases = mx.quantize(module.weight[3], 64, 4)
        for name, ref in (("weight", wq), ("scales", scales), ("biases", biases)):
            np.testing.assert_array_equal(got[f"{proj}.{name}"], np.array(ref.view(mx.uint16)) if ref.dtype ==
                                          mx.bfloat16 else np.array(ref), err_msg=f"{proj}.{name}")
        if "bias" in module:
            np.testing.assert_array_equal(got[f"{proj}.bias"], np.array(module.bias[3].view(mx.uint16)))
    if synth.for_mlx_lm(hf) != hf:  # gpt-oss: mlx-lm's float layout converts to the same records
        assert convert.main([str(synth.for_mlx_lm(hf)), str(hf.parent / "from-mlx"), "--no-progress"]) == 0
        again = Store(hf.parent / "from-mlx")
        assert again.layouts == ours.layouts
        for key in ours.records:
            np.testing.assert_array_equal(np.frombuffer(again.read_record(again.record(*key)), np.uint8),
                                          np.frombuffer(ours.read_record(ours.record(*key)), np.uint8))


def test_greedy_tokens_equal_mlx_lm_in_process(family):
    """mlx-lm's generate_step, token for token, with every expert resident; gpt-oss's decode runs
    past its window (mlx-lm's rotating cache holds the window's keys out of temporal order then)."""
    from deltafin.tools.mmap_baseline import run_inprocess
    q4, store, _ = family
    prompt, n = PROMPT[:3], 24
    ref = mlx_lm_greedy(q4, prompt, n)
    cfg = Config().to_dict()
    assert run_inprocess(store.path, cfg, prompt, n, source="slots")["token_ids"] == ref


@pytest.fixture(scope="module")
def glm_run(tmp_path_factory):
    """A glm4_moe store and mlx-lm's greedy tokens on its checkpoint."""
    root = tmp_path_factory.mktemp("glm-run")
    hf = synth.tiny("glm4_moe", root / "hf", experts=8, moe_intermediate=64, seed=8, dtype="bfloat16")
    mlx_convert(str(hf), str(root / "q4"), quantize=True, q_bits=4, q_group_size=64)
    assert convert.main([str(root / "q4"), str(root / "store"), "--no-progress"]) == 0
    prompt, n = PROMPT[:9], 32
    return Store(root / "store"), prompt, n, mlx_lm_greedy(root / "q4", prompt, n)


@pytest.mark.parametrize("share,prefetch", [(1.0, True), (0.25, True), (0.25, False)])
def test_greedy_tokens_equal_mlx_lm_in_real_processes(glm_run, share, prefetch, tmp_path):
    """glm4_moe served by the supervisor and its workers: all experts resident, and a quarter
    with prefetch on and off."""
    from conftest import config_flags
    from deltafin.client import Client
    from deltafin.tools.run import running_supervisor
    store, prompt, n, ref = glm_run
    slots = max(store.top_k, int(len(store.records) * share))
    flags = ["--max-slots", str(slots), *config_flags(tmp_path, cache={"prefetch": prefetch})]
    with running_supervisor(store.path, "4GiB", flags) as (ep, _):
        with Client(ep, timeout=120) as c:
            got = c.generate(prompt, max_tokens=n).token_ids
    assert got == ref


def resident_model(q4, config: dict):
    """runtime/models' model of an mlx-lm checkpoint under `config`, with its experts stacked as
    mlx-lm stacks them (ResidentExperts)."""
    from deltafin.runtime.models import ResidentExperts, build_model
    info = archinfo.arch_for(config)
    weights = {k: v for f in sorted(q4.glob("model*.safetensors")) for k, v in mx.load(str(f)).items()}
    dense, experts = {}, {}
    for k, v in weights.items():
        m = re.match(rf"^model\.layers\.(\d+)\.{info.block}\.{info.stacked}\.(\w+\.\w+)$", k)
        if m:
            experts.setdefault(int(m[1]), {})[m[2]] = v
        else:
            dense[k] = v
    q = config["quantization"]
    return build_model(config, dense, q, "auto"), ResidentExperts(experts, q["bits"], q["group_size"],
                                                                 activation=info.activation(config))


def test_a_transformers_5_config_runs_as_its_mlx_lm_spelling(family):
    """Without the top-level keys mlx-lm needs (rope_theta; GLM's partial_rotary_factor), read from
    rope_parameters as transformers 5 writes them: the same logits."""
    q4 = family[0]
    config = json.loads((q4 / "config.json").read_text())
    bare = {k: v for k, v in config.items() if k not in ("rope_theta", "partial_rotary_factor")}
    assert bare["rope_parameters"]["rope_theta"] == config["rope_theta"]
    logits = [np.array(m(mx.array(PROMPT), m.make_cache(), e)) for m, e in
              (resident_model(q4, config), resident_model(q4, bare))]
    np.testing.assert_array_equal(logits[0], logits[1])
    np.testing.assert_array_equal(logits[0], mlx_lm_logits(q4, PROMPT))


def test_decode_step_by_step_equals_mlx_lm_with_its_caches(family):
    """The model alone (runtime/models, every expert stacked as mlx-lm stacks them): a prefill, a
    second chunk at an offset, then one token a pass, against mlx-lm with its own caches, bit for
    bit: gpt-oss's sliding layers run 22 positions past their window of 8 (mlx-lm's rotating
    cache)."""
    from mlx_lm.models.cache import make_prompt_cache
    q4 = family[0]
    model, resident = resident_model(q4, json.loads((q4 / "config.json").read_text()))
    ref_model, _ = load_model(q4)
    ids = PROMPT + PROMPT[:14]
    ref_cache, cache = make_prompt_cache(ref_model), model.make_cache()
    ref, ours = [], []
    for a, b in ((0, 6), (6, 11)):  # a prefill, then a chunk at an offset (a window mask from row 6 on)
        ref.append(ref_model(mx.array([ids[a:b]]), cache=ref_cache)[0].astype(mx.float32))
        ours.append(model(mx.array(ids[a:b]), cache, resident))
    for t in ids[11:]:
        ref.append(ref_model(mx.array([[t]]), cache=ref_cache)[0].astype(mx.float32))
        ours.append(model(mx.array([t]), cache, resident))
    np.testing.assert_array_equal(np.array(mx.concatenate(ours)), np.array(mx.concatenate(ref)))


# ---------------------------------------------------------------- gpt-oss in OpenAI's own mxfp4 layout

MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def _openai_mxfp4(hf, out):
    """The tiny gpt-oss checkpoint as OpenAI publishes gpt-oss: each layer's experts as random
    mxfp4 codes, gate_up_proj_blocks [E, 2I, H/32, 16] and down_proj_blocks [E, H, I/32, 16]
    (uint8, two E2M1 codes a byte) with E8M0 _scales [E, out, G] (2^-8 to 2^-4), the biases and
    every other tensor as synth wrote them; config.json says quantization_config mxfp4."""
    import shutil
    shutil.copytree(hf, out)
    rng = np.random.default_rng(7)
    for f in out.glob("model*.safetensors"):
        w = mx.load(str(f))
        for k in [k for k in w if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            n, d_in, d_out = w.pop(k).shape  # transformers' float layout: [E, in, out]
            w[f"{k}_blocks"] = mx.array(rng.integers(0, 256, (n, d_out, d_in // 32, 16), dtype=np.uint8))
            w[f"{k}_scales"] = mx.array(rng.integers(119, 124, (n, d_out, d_in // 32), dtype=np.uint8))
        mx.save_safetensors(str(f), w, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))
    return out


@pytest.fixture(scope="module")
def openai_gpt_oss(tmp_path_factory):
    """(OpenAI-layout checkpoint, its deltafin store)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf = synth.tiny("gpt_oss", root / "hf", experts=8, moe_intermediate=64, seed=21, dtype="bfloat16",
                    overrides=OVERRIDES["gpt_oss"])
    src = _openai_mxfp4(hf, root / "openai")
    assert convert.main([str(src), str(root / "store"), "--no-progress"]) == 0
    return src, Store(root / "store")


def test_openai_mxfp4_experts_convert_byte_for_byte(openai_gpt_oss):
    """The records hold the blocks' bytes as MLX's mxfp4 (group 32, E8M0 scales), gate and up the
    even and odd rows of gate_up_proj; dequantized, each equals transformers' own dequantization
    of OpenAI's blocks (its integrations.mxfp4: low nibble first, 2^(scale - 127))."""
    src, store = openai_gpt_oss
    assert store.mode == "mxfp4" and (store.bits, store.group_size) == (4, 32)
    layer, e = store.moe_layers[-1], 5
    w = {k: v for f in src.glob("model*.safetensors") for k, v in mx.load(str(f)).items()}
    prefix = f"model.layers.{layer}.mlp.experts"
    got = store.read_expert(layer, e)
    for proj in archinfo.PROJS:
        assert store.layout(layer)["quant"][proj] == {"bits": 4, "group_size": 32, "mode": "mxfp4"}
        fused, rows = ("down_proj", slice(None)) if proj == "down_proj" else \
            ("gate_up_proj", slice(0, None, 2) if proj == "gate_proj" else slice(1, None, 2))
        blocks = np.array(w[f"{prefix}.{fused}_blocks"][e])[rows]
        np.testing.assert_array_equal(got[f"{proj}.weight"].view(np.uint8).reshape(blocks.shape), blocks)
        np.testing.assert_array_equal(got[f"{proj}.scales"], np.array(w[f"{prefix}.{fused}_scales"][e])[rows])
        bias = w[f"{prefix}.{fused}_bias"][e][rows]
        np.testing.assert_array_equal(got[f"{proj}.bias"], np.array(bias.view(mx.uint16)))
    torch = pytest.importorskip("torch")
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    for fused in ("gate_up_proj", "down_proj"):
        ref = convert_moe_packed_tensors(torch.from_numpy(np.array(w[f"{prefix}.{fused}_blocks"])),
                                         torch.from_numpy(np.array(w[f"{prefix}.{fused}_scales"])))
        ref = ref[e].float().numpy().T  # transformers' [E, in, out] -> [out, in]
        for proj, rows in ((("down_proj", slice(None)),) if fused == "down_proj" else
                           (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2)))):
            ours = mx.dequantize(mx.array(got[f"{proj}.weight"]), mx.array(got[f"{proj}.scales"]),
                                 group_size=32, bits=4, mode="mxfp4")
            np.testing.assert_array_equal(np.array(ours.astype(mx.float32)), ref[rows], err_msg=proj)


def test_openai_mxfp4_logits_equal_mlx_lm_on_the_same_checkpoint(openai_gpt_oss):
    """mlx-lm 0.32.2 loads OpenAI's layout itself (quant_method mxfp4 -> mxfp4 group 32, its
    sanitize splitting the blocks): the runtime's teacher-forced logits equal mlx-lm's on that
    very checkpoint, bit for bit, with every expert resident, a quarter and the minimum."""
    src, store = openai_gpt_oss
    logits_equal_mlx_lm_at_every_budget(src, store)


def test_openai_mxfp4_refuses_requantization(openai_gpt_oss, tmp_path, capsys):
    src, _ = openai_gpt_oss
    assert convert.main([str(src), str(tmp_path / "s"), "--mode", "affine", "--bits", "4", "--no-progress"]) == 2
    assert "already quantized by OpenAI (mxfp4)" in capsys.readouterr().err
