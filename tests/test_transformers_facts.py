"""The facts the torch-based tests establish, checked on every run without torch (CI has none:
the registry's torch is a multi-GB CUDA build). tests/fixtures/record_transformers.py recorded,
with transformers and a CPU torch, for each tiny checkpoint deltafin-synth writes: the tensor
names, shapes and dtypes of the checkpoint transformers saves from the same config, the config
keys it writes and how it reads synth's keys, and fingerprints of its logits. Here synth's output,
our float forward pass and mlx-lm's are compared against those records.

A synth change that alters its output fails here until the fixtures are recorded again (the
command is in the recorder's docstring), which also reruns transformers on the new output."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from deltafin.runtime import archinfo
from deltafin.tools import synth
from fixtures.record_transformers import (PROJECTIONS, collapsed, config_digest, named, projections,
                                          safetensors_tensors, synth_case_name)

FIXTURES = Path(__file__).parent / "fixtures" / "transformers"
CHECKPOINTS = json.loads((FIXTURES / "checkpoints.json").read_text())
MODEL_LOGITS = json.loads((FIXTURES / "model_logits.json").read_text())


def _close_to_record(logits: np.ndarray, rec: dict, atol: float, what: str) -> float:
    """Projections on unit vectors move by at most the L2 norm of the difference: a logits
    difference within atol per entry moves them by ~atol (random signs), a wrong model by O(1)."""
    assert list(logits.shape) == rec["shape"], what
    got = logits.astype(np.float64) @ projections(logits.shape[1])
    dev = float(np.abs(got - np.array(rec["projections"])).max())
    assert dev <= 4 * atol, f"{what}: projections of the logits moved by {dev:.2e} (> {4 * atol:.1e})"
    assert abs(float(np.abs(logits).max()) - rec["max_abs"]) <= atol, what
    decided = np.array(rec["margin"]) > 1e-3
    assert (logits.argmax(-1) == np.array(rec["argmax"]))[decided].all(), f"{what}: argmax differs"
    return dev


def test_fixtures_cover_every_torch_case():
    """Every case of test_synth and test_models has a record and no record is stale; a family
    transformers has no class for (Kimi K3: mlx-lm's own model is its reference, test_kimi) is
    recorded as skipped, saying so, and has no logits case."""
    import test_models
    import test_synth
    cases = {synth_case_name(a, kw) for a, kw in test_synth.CASES + test_synth.OVERRIDES + test_synth.BIAS_OVERRIDES}
    assert set(CHECKPOINTS) == cases
    assert set(MODEL_LOGITS) == set(test_models.CASES)
    skipped = {rec["synth"]["arch"]: rec["skipped"] for rec in CHECKPOINTS.values() if "skipped" in rec}
    assert all(f"has no {arch} class" in why for arch, why in skipped.items()), skipped
    assert not skipped.keys() & {case[0] for case in test_models.CASES.values()}
    assert PROJECTIONS == len(MODEL_LOGITS["mixtral"]["logits"]["projections"][0])


def _shapes(folded: dict) -> dict:
    return {k: [[shape, experts, layers] for shape, _, experts, layers in v] for k, v in folded.items()}


@pytest.mark.parametrize("name", sorted(n for n, r in CHECKPOINTS.items() if "skipped" not in r))
def test_synth_checkpoint_is_what_transformers_saves(name, tmp_path):
    """test_keys_match_transformers and test_overrides_keys_match_transformers, from the record."""
    rec = CHECKPOINTS[name]
    kw = dict(rec["synth"])
    path = synth.tiny(kw.pop("arch"), tmp_path / "s", **kw)
    config = json.loads((path / "config.json").read_text())
    assert config_digest(config) == rec["config_sha256"]  # the config the record's readings are of
    ours = safetensors_tensors(path)
    assert synth.tensor_shapes(config) == {k: tuple(v[0]) for k, v in ours.items()}
    flat = archinfo.text_model(config)
    info = archinfo.arch_for(flat)
    if flat is config:  # names, shapes and dtypes
        assert collapsed(named(info, ours)) == rec["tensors"]
    else:  # Qwen3.5-MoE publishes a nested, fused layout; its ForCausalLM's flat one is synth's flat shapes
        flat_shapes = {k: [list(shape), None] for k, shape in synth.tensor_shapes(flat).items()}
        assert _shapes(collapsed(named(info, flat_shapes))) == _shapes(rec["tensors"])
    # every key transformers writes is one synth writes or one transformers derives itself (Kimi
    # Linear's from linear_attn_config, gpt-oss's swiglu_alpha constant, defaults of unused options)
    assert set(rec["config_keys_added"]) <= {
        "transformers_version", "head_dim", "qk_head_dim", "mlp_bias", "pretraining_tp", "router_jitter_noise",
        "layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "linear_conv_kernel_dim",
        "q_lora_rank", "attention_bias", "swiglu_alpha"}, rec["config_keys_added"]
    # transformers reads every key synth writes as written, but for normalized spellings (rope
    # type alias, sliding_window 0 -> None)
    differ = rec["config_read_differently"]
    assert set(differ) | set(differ.get("text_config", {})) <= {"rope_parameters", "sliding_window", "text_config"}


@pytest.mark.parametrize("name", sorted(n for n, r in CHECKPOINTS.items() if "logits" in r))
def test_mlx_lm_reads_synth_like_transformers(name, tmp_path):
    """test_loads_in_mlx_lm_and_transformers_alike, against transformers' recorded logits."""
    pytest.importorskip("mlx_lm")
    import test_synth
    rec = CHECKPOINTS[name]
    kw = dict(rec["synth"])
    path = synth.tiny(kw.pop("arch"), tmp_path / "s", **kw)
    ids, logits = test_synth._mlx_logits(path)
    assert ids == rec["logits_text_ids"]
    _close_to_record(logits, rec["logits"], 2e-4, name)
    assert rec["logits"]["max_abs"] > 1.0  # unit-scale init: logits are not flat


@pytest.mark.parametrize("name", sorted(MODEL_LOGITS))
def test_float_weights_match_recorded_transformers(name, tmp_path):
    """test_models.test_float_weights_match_transformers, against the recorded logits."""
    pytest.importorskip("mlx_lm")
    import test_models
    rec = MODEL_LOGITS[name]
    model_type, tiny_args, overrides, dtype = test_models.CASES[name]
    hf_dir = synth.tiny(model_type, tmp_path / "hf", overrides=overrides, **tiny_args)
    test_models._randomize_norms(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    tokens = np.array(rec["tokens"], dtype=np.int32)
    case = test_models.Case(name, config, hf_dir, tmp_path / "unused", tokens, dtype)
    ours = test_models._float_chunked(case)
    _close_to_record(ours, rec["logits"], 1e-4 * rec["logits"]["max_abs"], name)
