"""Quantization modes end to end against mlx-lm 0.32.2.

Tiny checkpoints quantized by mlx-lm's own convert in each mode (affine 2-8 bit at groups 32, 64
and 128, mxfp4, nvfp4, mxfp8, the mixed_3_6 recipe), converted by deltafin-convert, give mlx-lm's
teacher-forced logits bit for bit with every expert resident and with 25% of them; float and FP8
(DeepSeek-V3 layout) checkpoints quantized by deltafin-convert give mlx-lm's expert bytes; old
stores open and corrupt mode entries are refused clearly."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm import convert as mlx_convert  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from deltafin.runtime.config import Config  # noqa: E402
from deltafin.runtime.store import Store, StoreError  # noqa: E402
from deltafin.tools import convert  # noqa: E402
from deltafin.tools.synth import tiny  # noqa: E402

IDS = [1, 17, 42, 99, 3, 250, 7, 301, 64, 12, 5, 400]
# mode -> mlx_lm.convert arguments
MODES = {
    "affine2_g32": dict(q_bits=2, q_group_size=32),
    "affine3_g64": dict(q_bits=3, q_group_size=64),
    "affine5_g128": dict(q_bits=5, q_group_size=128),
    "affine6_g32": dict(q_bits=6, q_group_size=32),
    "affine8_g128": dict(q_bits=8, q_group_size=128),
    "mxfp4": dict(q_mode="mxfp4"),
    "nvfp4": dict(q_mode="nvfp4"),
    "mxfp8": dict(q_mode="mxfp8"),
    "mixed_3_6": dict(quant_predicate="mixed_3_6"),
}
FLAGS = {"q_bits": "--bits", "q_group_size": "--group-size", "q_mode": "--mode",
         "quant_predicate": "--quant-predicate"}
MLA = dict(n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=128, qk_rope_head_dim=32,
           qk_nope_head_dim=64, v_head_dim=64, q_lora_rank=64, n_group=2, topk_group=1,
           routed_scaling_factor=2.5)
FP8_BLOCK = 128


def _flags(kwargs: dict) -> list[str]:
    """deltafin-convert's flags for the same quantization as mlx_lm.convert's kwargs."""
    return [x for k, v in kwargs.items() for x in (FLAGS[k], str(v))]


def _convert(src: Path, out: Path, *flags) -> Store:
    assert convert.main([str(src), str(out), "--no-progress", *flags]) == 0
    return Store(out)


def _mlx_lm_logits(mlx_dir: Path) -> np.ndarray:
    model, _ = load_model(mlx_dir)
    return np.array(model(mx.array([IDS]))[0].astype(mx.float32))


def _deltafin_logits(store: Store, slots: int) -> np.ndarray:
    """Teacher-forced logits of compute in this process, router and loader wired in (real reads
    into `slots` resident slots; 0: every expert, preloaded)."""
    from deltafin.tools.inprocess import local_router
    from deltafin.workers.engine import Compute
    cfg = Config().to_dict()
    cfg["compute"]["dtype"] = "auto"  # the checkpoint's bfloat16, as mlx-lm runs it
    source, staging, loader = local_router(store, cfg, n_slots=slots)
    try:
        compute = Compute(store, cfg, source, staging, store.max_record_bytes)
        if not slots:
            compute.preload()
        return compute.logits(IDS)
    finally:
        loader.close()


def _assert_runs_like_mlx_lm(mlx_dir: Path, store: Store) -> None:
    ref = _mlx_lm_logits(mlx_dir)
    quarter = len(store.records) // 4
    assert store.top_k <= quarter < len(store.records)
    for slots in (0, quarter):
        got = _deltafin_logits(store, slots)
        assert np.array_equal(got, ref), (f"{slots or 'all'} slots: max |diff| "
                                          f"{np.abs(got - ref).max():.3g} from mlx-lm's logits")


def _assert_records_equal_mlx_lm(store: Store, mlx_dir: Path) -> None:
    """Every record tensor equals mlx-lm's stacked switch_mlp tensor at that expert."""
    weights = {}
    for f in mlx_dir.glob("model*.safetensors"):
        weights.update(mx.load(str(f)))
    for (layer, e) in store.records:
        for name, arr in store.read_expert(layer, e).items():
            ref = weights[f"model.layers.{layer}.mlp.switch_mlp.{name}"][e]
            ref = np.array(ref.view(mx.uint16) if ref.dtype == mx.bfloat16 else ref)
            assert np.array_equal(arr, ref), (layer, e, name)


# ---------------------------------------------------------------- mlx-lm's modes, qwen3_moe

@pytest.fixture(scope="module")
def qwen_hf(tmp_path_factory) -> Path:
    return tiny("qwen3_moe", tmp_path_factory.mktemp("qwen") / "hf", seed=12, dtype="bfloat16")


@pytest.fixture(scope="module", params=list(MODES))
def quantized(request, qwen_hf, tmp_path_factory):
    """(mode, mlx-lm's checkpoint in that mode, deltafin's store converted from it)."""
    root = tmp_path_factory.mktemp(request.param)
    mlx_convert(str(qwen_hf), str(root / "mlx"), quantize=True, **MODES[request.param])
    return request.param, root / "mlx", _convert(root / "mlx", root / "store")


def test_mlx_lm_checkpoints_run_bit_identical(quantized):
    mode, mlx_dir, store = quantized
    quant = json.loads((mlx_dir / "config.json").read_text())["quantization"]
    for layer in store.moe_layers:
        for proj, q in store.layout(layer)["quant"].items():
            o = quant.get(f"model.layers.{layer}.mlp.switch_mlp.{proj}") or quant
            assert q["mode"] == o.get("mode", "affine") and q["bits"] == o["bits"]
    if mode == "mixed_3_6":  # layer 1 of 2 is in the last eighth: its down_proj gets 6 bits
        assert [store.layout(layer)["quant"]["down_proj"]["bits"] for layer in store.moe_layers] == [3, 6]
        _assert_sizes_are_per_layer(store)
    _assert_runs_like_mlx_lm(mlx_dir, store)


def test_float_checkpoint_quantizes_to_mlx_lm_bytes(quantized, qwen_hf, tmp_path):
    mode, mlx_dir, _ = quantized
    store = _convert(qwen_hf, tmp_path / "store", *_flags(MODES[mode]))
    _assert_records_equal_mlx_lm(store, mlx_dir)
    no_biases = mode in ("mxfp4", "nvfp4", "mxfp8")
    names = {t["name"] for t in store.layout(store.moe_layers[0])["tensors"]}
    assert ("gate_proj.biases" in names) is not no_biases
    if mode in ("nvfp4", "mixed_3_6"):  # the export names each projection's mode for mlx-lm
        from deltafin.tools.export_mlx import export_mlx
        export_mlx(store.path, tmp_path / "export")
        assert np.array_equal(_mlx_lm_logits(tmp_path / "export"), _deltafin_logits(store, 0))


def _assert_sizes_are_per_layer(store: Store) -> None:
    """A store whose layers' records differ: the budget, the forecast and the replay take each
    layer's own size."""
    from deltafin.runtime.budget import plan_budget
    from deltafin.tools.forecast import Shape
    from deltafin.tools.replay import layer_read_bytes, replay
    nbytes = {g: layout["nbytes"] for g, layout in store.layouts.items()}
    assert len(set(nbytes.values())) == 2
    plan = plan_budget(store, Config())
    assert plan.resident_bytes == nbytes  # float tensors kept in their stored dtype ("auto")
    sizes = layer_read_bytes(store)
    assert sizes == [store.record(layer, 0).read_nbytes for layer in store.moe_layers]
    assert list(Shape.of_store(store).layer_bytes) == sizes
    n = len(sizes)
    sizes = [16384 * (i + 1) for i in range(n)]  # reads of other sizes per layer (bigger models)
    ids = np.random.default_rng(0).integers(0, store.n_experts, (6, n, store.top_k))
    got = replay(ids, len(store.records), "lru", record_bytes=sizes)  # all fit: one read per first use
    first_uses = [len(np.unique(ids[:, layer])) for layer in range(n)]
    assert got["bytes_read_per_token"] == sum(u * b for u, b in zip(first_uses, sizes)) / 6


def test_streaming_nvfp4_greedy_tokens_equal_mlx_lm_prefetch_on_and_off(qwen_hf, tmp_path):
    """Real processes (supervisor, router, loader, compute over shared memory), bfloat16, 25% of
    the experts resident: greedy tokens equal mlx-lm's on the store's own mlx-lm export."""
    from mlx_lm.generate import generate_step

    from conftest import config_flags
    from deltafin.client import Client
    from deltafin.tools.export_mlx import export_mlx
    from deltafin.tools.run import running_supervisor
    store = _convert(qwen_hf, tmp_path / "store", "--mode", "nvfp4")
    export_mlx(store.path, tmp_path / "export")
    model, _ = load_model(tmp_path / "export")
    prompt, n = IDS[:6], 24
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]
    for prefetch in (True, False):
        flags = config_flags(tmp_path, cache={"prefetch": prefetch, "max_slots": len(store.records) // 4},
                             compute={"dtype": "auto"})
        with running_supervisor(store.path, "4GiB", flags) as (ep, _):
            with Client(ep, timeout=120) as c:
                got = c.generate(prompt, max_tokens=n).token_ids
        assert got == ref, f"prefetch {prefetch}: tokens differ from mlx-lm's"


def _down_proj_override(path: str, _module):
    """mxfp4 everywhere but the experts' down_proj: mxfp8 in layer 1, affine 6-bit (an override
    without "mode") in layer 0."""
    if path.endswith("switch_mlp.down_proj"):
        return {"bits": 8, "group_size": 32, "mode": "mxfp8"} if ".1." in path else {"bits": 6, "group_size": 64}
    return True


def test_per_module_overrides_mix_modes_in_one_layer(qwen_hf, tmp_path):
    mlx_convert(str(qwen_hf), str(tmp_path / "mlx"), quantize=True, q_mode="mxfp4",
                quant_predicate=_down_proj_override)
    store = _convert(tmp_path / "mlx", tmp_path / "store")
    modes = [[store.layout(layer)["quant"][p]["mode"] for p in ("gate_proj", "down_proj")]
             for layer in store.moe_layers]
    assert modes == [["mxfp4", "affine"], ["mxfp4", "mxfp8"]]
    _assert_runs_like_mlx_lm(tmp_path / "mlx", store)


# ---------------------------------------------------------------- a mixed recipe on DeepSeek-V3

def test_deepseek_v3_mixed_recipe_runs_bit_identical(tmp_path):
    src = tiny("deepseek_v3", tmp_path / "hf", layers=5, moe_intermediate=64, dtype="bfloat16", seed=4,
               overrides=MLA)
    mlx_convert(str(src), str(tmp_path / "mlx"), quantize=True, quant_predicate="mixed_3_6")
    store = _convert(tmp_path / "mlx", tmp_path / "store")
    # 5 layers: layers 2 (every third after the first eighth) and 4 (the last eighth) get 6 bits
    assert [store.layout(layer)["quant"]["down_proj"]["bits"] for layer in store.moe_layers] == [3, 6, 3, 6]
    _assert_sizes_are_per_layer(store)
    _assert_runs_like_mlx_lm(tmp_path / "mlx", store)


# ---------------------------------------------------------------- FP8 checkpoints (DeepSeek-V3 layout)

def _fp8_checkpoint(src: Path, dst: Path, shards: int = 2) -> Path:
    """src's linear weights as DeepSeek-V3's FP8 release stores them: float8_e4m3fn, one float32
    `weight_scale_inv` per 128x128 block (amax / 448), sharded (torch does the rounding)."""
    import torch
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, w in load_file(str(f)).items():
            if not name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
                out[name] = w
                continue
            m, n = w.shape
            padded = torch.nn.functional.pad(w.float(), (0, -n % FP8_BLOCK, 0, -m % FP8_BLOCK))
            blocks = padded.reshape(padded.shape[0] // FP8_BLOCK, FP8_BLOCK, -1, FP8_BLOCK)
            scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
            q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:m, :n]
            out[name], out[name + "_scale_inv"] = q.to(torch.float8_e4m3fn).contiguous(), scale
    names, weight_map = sorted(out), {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: out[k] for k in names[i::shards]}
        save_file(part, str(dst / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def _dequantized_bf16_checkpoint(fp8_dir: Path, dst: Path) -> Path:
    """The FP8 checkpoint dequantized with numpy alone: each e4m3 byte decoded, times its block's
    float32 scale, rounded to bfloat16 (to nearest even)."""
    import torch
    from safetensors.torch import load_file, save_file
    dst.mkdir(parents=True)
    weights = {}
    for f in sorted(fp8_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    out = {}
    for name, w in weights.items():
        if name.endswith("_scale_inv"):
            continue
        if w.dtype != torch.float8_e4m3fn:
            out[name] = w
            continue
        b = w.view(torch.uint8).numpy().astype(np.int64)
        exp, man = (b >> 3) & 0xF, (b & 7).astype(np.float64)
        val = np.where(exp == 0, man / 8 * 2.0 ** -6, (1 + man / 8) * 2.0 ** (exp - 7))
        val = np.where(b >> 7, -val, val).astype(np.float32)
        scale = weights[name + "_scale_inv"].numpy()
        full = np.repeat(np.repeat(scale, FP8_BLOCK, 0), FP8_BLOCK, 1)[:val.shape[0], :val.shape[1]]
        bits = (val * full).view(np.uint32).astype(np.uint64)
        bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        out[name] = torch.from_numpy(bf16.view(np.int16)).view(torch.bfloat16)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((fp8_dir / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for f in fp8_dir.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory) -> Path:
    pytest.importorskip("torch")
    root = tmp_path_factory.mktemp("fp8")
    src = tiny("deepseek_v3", root / "hf", moe_intermediate=64, dtype="bfloat16", seed=5, overrides=MLA)
    return _fp8_checkpoint(src, root / "fp8")


@pytest.mark.parametrize("mode", ["affine3_g64", "mxfp4", "nvfp4"])
def test_fp8_checkpoint_requantizes_like_mlx_lm(fp8_dir, mode, tmp_path):
    """mlx-lm reads the FP8 checkpoint itself (DeepSeek-V3's sanitize dequantizes it) and
    quantizes its experts in the mode; deltafin-convert gives the same bytes and the same logits."""
    mlx_convert(str(fp8_dir), str(tmp_path / "mlx"), quantize=True,
                quant_predicate=lambda path, _: "switch_mlp" in path, **MODES[mode])
    store = _convert(fp8_dir, tmp_path / "store", *_flags(MODES[mode]))
    assert len(list(fp8_dir.glob("*.safetensors"))) == 2
    _assert_records_equal_mlx_lm(store, tmp_path / "mlx")
    _assert_runs_like_mlx_lm(tmp_path / "mlx", store)


def test_fp8_checkpoint_equals_its_numpy_dequantization(fp8_dir, tmp_path):
    bf16 = _dequantized_bf16_checkpoint(fp8_dir, tmp_path / "bf16")
    a = _convert(fp8_dir, tmp_path / "a", "--mode", "mxfp8")
    b = _convert(bf16, tmp_path / "b", "--mode", "mxfp8")
    assert a.layouts == b.layouts and a.records.keys() == b.records.keys()
    assert all(a.records[k].checksum == b.records[k].checksum for k in a.records)
    da, db = a.dense_weights(), b.dense_weights()
    assert da.keys() == db.keys() and not any(k.endswith("_scale_inv") for k in da)
    for k in da:
        assert da[k].dtype == db[k].dtype and mx.array_equal(da[k], db[k]).item(), k
    assert convert.main(["--verify", str(tmp_path / "a"), "--no-progress"]) == 0


def test_fp8_settings_not_read_are_refused(fp8_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [64, 64]
    (bad / "config.json").write_text(json.dumps(config))
    assert convert.main([str(bad), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "weight_block_size [64, 64]" in capsys.readouterr().err
    del config["quantization_config"]
    (bad / "config.json").write_text(json.dumps(config))
    assert convert.main([str(bad), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "float8_e4m3fn; expected float16/bfloat16/float32" in capsys.readouterr().err


# ---------------------------------------------------------------- store versions and bad entries

@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """An mlx-lm 3-bit checkpoint and its store, and an mxfp4 store."""
    root = tmp_path_factory.mktemp("small")
    src = tiny("qwen3_moe", root / "hf", seed=3, dtype="bfloat16")
    mlx_convert(str(src), str(root / "mlx"), quantize=True, q_bits=3, q_group_size=64)
    _convert(root / "mlx", root / "affine")
    _convert(src, root / "mxfp4", "--mode", "mxfp4")
    return root


def _edit_manifest(store: Path, edit) -> None:
    m = json.loads((store / "manifest.json").read_text())
    edit(m)
    (store / "manifest.json").write_text(json.dumps(m))


def _as_version_1(m: dict) -> None:
    """The manifest a version-1 deltafin wrote: no mode anywhere."""
    m["version"] = 1
    del m["quantization"]["mode"]
    for layout in m["layouts"].values():
        for q in layout["quant"].values():
            del q["mode"]


def test_version_1_store_opens_as_affine_and_runs_exact(small, tmp_path):
    shutil.copytree(small / "affine", tmp_path / "v1")
    _edit_manifest(tmp_path / "v1", _as_version_1)
    store = Store(tmp_path / "v1")
    assert store.mode == "affine"
    assert all(q["mode"] == "affine" for lay in store.layouts.values() for q in lay["quant"].values())
    assert np.array_equal(_deltafin_logits(store, 0), _mlx_lm_logits(small / "mlx"))


def test_version_1_manifest_over_mxfp4_records_is_refused(small, tmp_path):
    shutil.copytree(small / "mxfp4", tmp_path / "v1")
    _edit_manifest(tmp_path / "v1", _as_version_1)
    with pytest.raises(StoreError, match=r"needs tensors .*biases"):
        Store(tmp_path / "v1")


@pytest.mark.parametrize("entry, message", [
    ({"bits": 4, "group_size": 32, "mode": "mxfp5"}, "unknown quantization mode 'mxfp5'"),
    ({"bits": 8, "group_size": 32, "mode": "mxfp4"}, "mxfp4 is 4 bits at group 32"),
    ({"bits": 4, "group_size": 32}, "corrupt quantization entry"),
    ({"bits": 4, "group_size": 16, "mode": "nvfp4"}, "do not fit 4 bits at group 16"),
    ({"bits": 4, "group_size": 64, "mode": "affine"}, "needs tensors"),
])
def test_corrupt_mode_entry_is_a_clear_error(small, tmp_path, entry, message):
    shutil.copytree(small / "mxfp4", tmp_path / "s")

    def edit(m):
        for layout in m["layouts"].values():
            layout["quant"]["up_proj"] = entry
    _edit_manifest(tmp_path / "s", edit)
    with pytest.raises(StoreError, match=message) as e:
        Store(tmp_path / "s")
    assert "layout L0 up_proj" in str(e.value)


@pytest.mark.parametrize("flags, message", [
    (["--mode", "mxfp4", "--bits", "8"], "mxfp4 is 4 bits at group 32"),
    (["--mode", "nvfp4", "--group-size", "32"], "nvfp4 is 4 bits at group 16"),
    (["--group-size", "16"], "affine quantization takes"),
    (["--mode", "mxfp8", "--quant-predicate", "mixed_3_6"], "recipe mixed_3_6 is affine"),
])
def test_converter_refuses_modes_mlx_does_not_define(small, tmp_path, capsys, flags, message):
    assert convert.main([str(small / "hf"), str(tmp_path / "out"), "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_converter_refuses_requantizing_an_mlx_lm_checkpoint_and_unknown_modes(small, tmp_path, capsys):
    assert convert.main([str(small / "mlx"), str(tmp_path / "out"), "--mode", "mxfp4", "--no-progress"]) == 2
    assert "already quantized by mlx-lm" in capsys.readouterr().err
    bad = tmp_path / "bad"
    shutil.copytree(small / "mlx", bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization"]["mode"] = "fp3"
    (bad / "config.json").write_text(json.dumps(config))
    assert convert.main([str(bad), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "unknown quantization mode 'fp3'" in capsys.readouterr().err
