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

from deltafin.tools import synth
from fixtures.record_transformers import PROJECTIONS, projections, safetensors_tensors, synth_case_name

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
    """No record is stale, and a family recorded has every case recorded. Families added since the
    last recording (the hybrids, Kimi, GLM-4.5, gpt-oss, MiniMax-M2) are checked against mlx-lm
    directly without torch (test_hybrids, test_kimi, test_families24) and against transformers
    with torch (test_synth, test_models) until the recorder runs again."""
    import test_models
    import test_synth
    cases = {synth_case_name(a, kw): a for a, kw in test_synth.CASES}
    cases |= {synth_case_name(a, kw): a for a, kw in test_synth.OVERRIDES + test_synth.BIAS_OVERRIDES}
    recorded = {rec["synth"]["arch"] for rec in CHECKPOINTS.values()}
    assert set(CHECKPOINTS) <= set(cases)
    assert {n for n, a in cases.items() if a in recorded} == set(CHECKPOINTS)
    model_cases = {name: case[0] for name, case in test_models.CASES.items()}
    assert set(MODEL_LOGITS) <= set(model_cases)
    assert {n for n, a in model_cases.items() if a in recorded} == set(MODEL_LOGITS)
    assert PROJECTIONS == len(MODEL_LOGITS["mixtral"]["logits"]["projections"][0])


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_synth_checkpoint_is_what_transformers_saves(name, tmp_path):
    """test_keys_match_transformers and test_overrides_keys_match_transformers, from the record."""
    rec = CHECKPOINTS[name]
    kw = dict(rec["synth"])
    path = synth.tiny(kw.pop("arch"), tmp_path / "s", **kw)
    assert safetensors_tensors(path) == rec["tensors"]  # names, shapes and dtypes
    config = json.loads((path / "config.json").read_text())
    # transformers' reading of the config holds for the config synth writes now
    assert config == rec["config_synth"]
    assert synth.tensor_shapes(config) == {k: tuple(v[0]) for k, v in rec["tensors"].items()}
    # every key transformers writes is one synth writes or one transformers derives itself
    derived = set(rec["config_keys"]) - set(config)
    assert derived <= {"transformers_version", "head_dim", "qk_head_dim", "mlp_bias", "pretraining_tp",
                       "router_jitter_noise", "layer_types"}, derived
    for key, value in rec["config_read"].items():
        if key in ("rope_parameters", "sliding_window"):  # normalized on reading (type alias, 0 -> None)
            continue
        assert config[key] == value, key


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
