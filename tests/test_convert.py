"""deltafin-convert and --verify: round trips, input formats, corruption, errors, bounded memory."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from deltafin.runtime import archinfo
from deltafin.runtime.store import ALIGN, Store, StoreError, checksum
from deltafin.runtime.tensorfile import index_checkpoint, read_header
from deltafin.tools import convert
from deltafin.tools.synth import for_mlx_lm, tiny

ARCHS = list(archinfo.ARCHS)


def _to_mx(arr, dtype):
    return convert.to_mx(arr, dtype)


def _source_expert(refs, info, layer, e):
    """The float projections of one expert as the checkpoint holds them (per-expert, fused, or
    mlx-lm's stacked layout: gpt-oss's, as synth.for_mlx_lm rewrites transformers' fused experts)."""
    fused = f"model.layers.{layer}.{info.block}.experts"
    if f"{fused}.gate_up_proj" in refs:
        gu, down = refs[f"{fused}.gate_up_proj"], refs[f"{fused}.down_proj"]
        w = gu.read_slice0(e)
        return {"gate_proj": (w[:len(w) // 2], gu.dtype), "up_proj": (w[len(w) // 2:], gu.dtype),
                "down_proj": (down.read_slice0(e), down.dtype)}
    inv = {v: k for k, v in info.proj_names.items()}
    out = {}
    for proj in archinfo.PROJS:
        stacked = refs.get(f"model.layers.{layer}.{info.block}.{info.stacked}.{proj}.weight")
        ref = stacked or refs[f"model.layers.{layer}.{info.block}.experts.{e}.{inv[proj]}.weight"]
        out[proj] = (ref.read_slice0(e) if stacked else ref.read(), ref.dtype)
    return out


def _check_store_matches_source(src: Path, store_path: Path, bits=4, group_size=64):
    store = Store(store_path)
    info = archinfo.arch_for(store.config)
    # the language model's names, as the family's model reads them
    refs = {archinfo.store_name(info, text): ref for n, ref in index_checkpoint(for_mlx_lm(src)).items()
            if (text := archinfo.text_name(n))}
    assert store.moe_layers == archinfo.moe_layers(store.config)
    for (layer, e), rec in store.records.items():
        assert rec.offset % ALIGN == 0
        got = store.read_expert(layer, e)
        for proj, (w, dtype) in _source_expert(refs, info, layer, e).items():
            wq, s, b = mx.quantize(_to_mx(w, dtype), group_size=group_size, bits=bits)
            # bit-identical to mx.quantize in the checkpoint's dtype
            assert np.array_equal(got[f"{proj}.weight"], np.array(wq))
            assert np.array_equal(got[f"{proj}.scales"], convert.to_np(s))
            assert np.array_equal(got[f"{proj}.biases"], convert.to_np(b))
            # and dequantizes to the original within one quantization step
            deq = mx.dequantize(mx.array(got[f"{proj}.weight"]), _to_mx(got[f"{proj}.scales"], dtype),
                                _to_mx(got[f"{proj}.biases"], dtype), group_size=group_size, bits=bits)
            orig = _to_mx(w, dtype).astype(mx.float32)
            step = mx.abs(mx.repeat(_to_mx(got[f"{proj}.scales"], dtype).astype(mx.float32), group_size, axis=-1))
            assert mx.all(mx.abs(deq.astype(mx.float32) - orig) <= step + 1e-2 * mx.abs(orig) + 1e-6).item()
    dense = store.dense_weights()
    expert_names = [n for n in refs if archinfo.expert_pattern(info).match(n) or archinfo.fused_pattern(info).match(n)
                    or archinfo.stacked_pattern(info).match(n)]
    assert set(dense) == set(refs) - set(expert_names)
    for name, arr in dense.items():
        ref = refs[name]
        np.testing.assert_array_equal(np.array(arr.view(mx.uint16) if arr.dtype == mx.bfloat16 else arr),
                                      ref.read())
    return store


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_every_architecture(tmp_path, arch):
    src = tiny(arch, tmp_path / "hf", seed=1)
    out = tmp_path / "store"
    assert convert.main([str(src), str(out), "--no-progress"]) == 0
    store = _check_store_matches_source(src, out)
    assert len(store.records) == len(store.moe_layers) * store.n_experts
    assert convert.main(["--verify", str(out), "--no-progress"]) == 0
    assert (out / "tokenizer" / "tokenizer.json").exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_and_sharded_input(tmp_path, dtype):
    src = tiny("qwen3_moe", tmp_path / "hf", dtype=dtype, shards=3, seed=2)
    assert (src / "model.safetensors.index.json").exists()
    out = tmp_path / "store"
    assert convert.main([str(src), str(out), "--no-progress"]) == 0
    store = _check_store_matches_source(src, out)
    assert store.layout(store.moe_layers[0])["tensors"][1]["dtype"] == dtype


def test_group_size_32_and_bits(tmp_path):
    src = tiny("mixtral", tmp_path / "hf", seed=3)
    out = tmp_path / "store"
    assert convert.main([str(src), str(out), "--group-size", "32", "--bits", "8", "--no-progress"]) == 0
    _check_store_matches_source(src, out, bits=8, group_size=32)


def _fuse_experts(src: Path, dst: Path):
    """Rewrite a checkpoint with transformers-5 fused experts (gate_up_proj [E,2I,H], down_proj [E,H,I])."""
    from safetensors.numpy import save_file
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors*"):
        f.unlink()
    cfg = json.loads((src / "config.json").read_text())
    info = archinfo.arch_for(cfg)
    refs = index_checkpoint(src)
    per = archinfo.expert_pattern(info)
    tensors = {n: r.read() for n, r in refs.items() if not per.match(n)}
    n = archinfo.n_experts(cfg)
    for layer in archinfo.moe_layers(cfg):
        p = f"model.layers.{layer}.{info.block}.experts"
        tensors[f"{p}.gate_up_proj"] = np.stack([np.concatenate(
            [refs[f"{p}.{e}.gate_proj.weight"].read(), refs[f"{p}.{e}.up_proj.weight"].read()]) for e in range(n)])
        tensors[f"{p}.down_proj"] = np.stack([refs[f"{p}.{e}.down_proj.weight"].read() for e in range(n)])
    save_file(tensors, str(dst / "model.safetensors"))


def test_fused_expert_tensors_equal_per_expert_conversion(tmp_path):
    src = tiny("olmoe", tmp_path / "hf", seed=4)
    _fuse_experts(src, tmp_path / "fused")
    assert convert.main([str(src), str(tmp_path / "a"), "--no-progress"]) == 0
    assert convert.main([str(tmp_path / "fused"), str(tmp_path / "b"), "--no-progress"]) == 0
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    assert [r.checksum for r in a.records.values()] == [r.checksum for r in b.records.values()]


def _mlx_lm_quantized(src: Path, dst: Path):
    pytest.importorskip("mlx_lm")
    from mlx_lm import convert as mlx_convert
    mlx_convert(str(src), str(dst), quantize=True, q_bits=4, q_group_size=64)
    return dst


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_mlx_lm_quantized_input_is_copied_byte_for_byte(tmp_path, arch):
    src = _mlx_lm_quantized(tiny(arch, tmp_path / "hf", seed=5), tmp_path / "mlx")
    out = tmp_path / "store"
    assert convert.main([str(src), str(out), "--no-progress"]) == 0
    store = Store(out)
    cfg = json.loads((src / "config.json").read_text())
    assert store.manifest["dense_quantization"] == cfg["quantization"]
    refs = index_checkpoint(src)
    info = archinfo.arch_for(cfg)
    for (layer, e) in store.records:
        got = store.read_expert(layer, e)
        for proj in archinfo.PROJS:
            for part in ("weight", "scales", "biases"):
                ref = refs[f"model.layers.{layer}.{info.block}.switch_mlp.{proj}.{part}"]
                np.testing.assert_array_equal(got[f"{proj}.{part}"], ref.read_slice0(e))
    dense = read_header(out / "dense.safetensors")
    assert not any("switch_mlp" in n for n in dense)
    assert any(n.endswith(".scales") for n in dense)
    assert convert.main(["--verify", str(out), "--no-progress"]) == 0


# -- corruption and truncation --------------------------------------------------------------

@pytest.fixture
def small_store(tmp_path):
    src = tiny("mixtral", tmp_path / "hf", seed=6)
    out = tmp_path / "store"
    assert convert.main([str(src), str(out), "--no-progress"]) == 0
    return out


def test_verify_names_a_corrupted_record(small_store, capsys):
    store = Store(small_store)
    rec = store.record(store.moe_layers[-1], 3)
    with open(small_store / rec.file, "r+b") as f:
        f.seek(rec.offset + rec.nbytes // 2)
        byte = f.read(1)
        f.seek(rec.offset + rec.nbytes // 2)
        f.write(bytes([byte[0] ^ 0x40]))
    assert convert.main(["--verify", str(small_store), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"layer {rec.layer} expert 3: checksum mismatch" in err
    assert err.count("BAD") == 1


def test_verify_names_truncated_records(small_store, capsys):
    store = Store(small_store)
    last = max((r for r in store.records.values() if r.layer == store.moe_layers[0]), key=lambda r: r.offset)
    os.truncate(small_store / last.file, last.offset + 100)
    assert convert.main(["--verify", str(small_store), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"layer {last.layer} expert {last.expert}" in err and "truncated" in err


def test_unreadable_stores_are_refused_clearly(small_store):
    m = json.loads((small_store / "manifest.json").read_text())
    m["version"] = 99
    (small_store / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(StoreError, match="version 99"):
        Store(small_store)
    (small_store / "manifest.json").write_text("{not json")
    with pytest.raises(StoreError, match="corrupt manifest"):
        Store(small_store)
    with pytest.raises(StoreError, match="not a deltafin store"):
        Store(small_store / "tokenizer")


def test_checksum_is_crc32_of_record_bytes(small_store):
    store = Store(small_store)
    rec = store.record(store.moe_layers[0], 0)
    raw = (small_store / rec.file).read_bytes()[rec.offset:rec.offset + rec.nbytes]
    assert checksum(raw) == rec.checksum


# -- errors leave nothing behind --------------------------------------------------------------

def _nothing_written(out: Path):
    return not out.exists() and not list(out.parent.glob(out.name + ".partial-*"))


def test_unknown_architecture(tmp_path, capsys):
    src = tiny("mixtral", tmp_path / "hf")
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "llama"
    (src / "config.json").write_text(json.dumps(cfg))
    assert convert.main([str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "unsupported architecture model_type='llama'" in capsys.readouterr().err
    assert _nothing_written(tmp_path / "out")


def test_missing_expert_tensor(tmp_path, capsys):
    from safetensors.numpy import save_file
    src = tiny("qwen2_moe", tmp_path / "hf")
    refs = index_checkpoint(src)
    drop = "model.layers.1.mlp.experts.5.up_proj.weight"
    save_file({n: r.read() for n, r in refs.items() if n != drop}, str(src / "model.safetensors"))
    assert convert.main([str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "layer 1 expert 5: missing tensors ['up_proj']" in capsys.readouterr().err
    assert _nothing_written(tmp_path / "out")


def test_shape_not_fitting_group_size(tmp_path, capsys):
    src = tiny("mixtral", tmp_path / "hf", hidden=96)
    assert convert.main([str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "does not fit group size 64" in capsys.readouterr().err
    assert _nothing_written(tmp_path / "out")


def test_interrupted_conversion_leaves_no_store(tmp_path, monkeypatch):
    src = tiny("mixtral", tmp_path / "hf")
    calls = {"n": 0}
    real = convert.StoreWriter.add_expert

    def flaky(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real(self, *a, **k)
    monkeypatch.setattr(convert.StoreWriter, "add_expert", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert.main([str(src), str(tmp_path / "out"), "--no-progress"])
    assert _nothing_written(tmp_path / "out")


def test_existing_output_is_not_overwritten(small_store, tmp_path, capsys):
    before = (small_store / "manifest.json").read_text()
    assert convert.main([str(tmp_path / "hf"), str(small_store), "--no-progress"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (small_store / "manifest.json").read_text() == before


def test_missing_config(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert convert.main([str(tmp_path / "empty"), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "no config.json" in capsys.readouterr().err


# -- bounded memory ------------------------------------------------------------------------------

def _peak_rss_mib(src: Path, out: Path) -> float:
    code = ("import resource, sys; from deltafin.tools.convert import main; "
            "rc = main([sys.argv[1], sys.argv[2], '--no-progress']); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return float(r.stdout.strip().splitlines()[-1])


def test_converter_memory_does_not_grow_with_model_size(tmp_path):
    # ~100 MB and ~200 MB float16 checkpoints: twice the experts per layer and twice the layers.
    small = tiny("mixtral", tmp_path / "small", layers=2, experts=16, hidden=512, moe_intermediate=768,
                 dtype="float16", vocab=512)
    large = tiny("mixtral", tmp_path / "large", layers=4, experts=16, hidden=512, moe_intermediate=768,
                 dtype="float16", vocab=512)
    size = lambda d: sum(f.stat().st_size for f in d.glob("*.safetensors"))
    assert size(large) > 1.9 * size(small)
    rss_small = _peak_rss_mib(small, tmp_path / "s_out")
    rss_large = _peak_rss_mib(large, tmp_path / "l_out")
    print(f"peak RSS: {size(small) / 2**20:.0f} MiB model -> {rss_small:.0f} MiB; "
          f"{size(large) / 2**20:.0f} MiB model -> {rss_large:.0f} MiB")
    assert rss_large < 1.2 * rss_small


def test_checkpoints_the_runtime_cannot_serve_are_refused(tmp_path, capsys):
    """An unparsable config, a top-k past the experts, one expert of another shape: refused
    naming what is wrong, nothing written (each once made a store the runtime refused or failed on)."""
    from safetensors.numpy import save_file
    src = tiny("qwen3_moe", tmp_path / "hf")
    cfg_text = (src / "config.json").read_text()
    (src / "config.json").write_text("{")
    assert convert.main([str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    assert "config.json: unreadable config" in capsys.readouterr().err
    cfg = json.loads(cfg_text)
    (src / "config.json").write_text(json.dumps({**cfg, "num_experts_per_tok": cfg["num_experts"] + 1}))
    assert convert.main([str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    assert f"picks {cfg['num_experts'] + 1} of {cfg['num_experts']} experts" in capsys.readouterr().err
    (src / "config.json").write_text(cfg_text)
    refs = index_checkpoint(src)
    odd = "model.layers.0.mlp.experts.1.down_proj.weight"
    tensors = {n: r.read() for n, r in refs.items()}
    shape = tensors[odd].shape
    tensors[odd] = np.zeros((shape[0] + 64, shape[1]), tensors[odd].dtype)
    save_file(tensors, str(src / "model.safetensors"))
    assert convert.main([str(src), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "layer 0 expert 1: down_proj." in err and "where expert 0 has" in err, err
    assert _nothing_written(tmp_path / "out")
