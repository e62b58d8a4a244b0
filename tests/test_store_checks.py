"""A corrupt or wrong store: a flipped bit in an expert record is caught by its CRC-32 before
use (the request fails naming layer, expert and file; the runtime keeps serving), and files that
do not match the manifest are refused at start with a message naming what is wrong."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys

import pytest

from deltafin.client import Client, ExpertUnavailableError
from deltafin.runtime.store import Store, StoreError
from deltafin.tools.run import running_supervisor

BIG = "4GiB"


@pytest.fixture
def store_copy(tiny_stores, tmp_path):
    shutil.copytree(tiny_stores("qwen3_moe"), tmp_path / "s")
    return tmp_path / "s"


def _start(store) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(store),
                           "--memory-budget", BIG], capture_output=True, text=True, timeout=120)


def test_a_flipped_bit_fails_the_request_naming_layer_expert_and_file(store_copy):
    store = Store(store_copy)
    layer = store.moe_layers[-1]
    rng = random.Random(5)
    for e in range(store.n_experts):  # one bit in every expert of the layer: any routing meets one
        rec = store.record(layer, e)
        pos = rec.offset + rng.randrange(rec.nbytes)
        with open(store.path / rec.file, "r+b") as f:
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    with running_supervisor(store_copy, BIG) as (ep, proc):  # sizes all match: it starts
        with Client(ep, timeout=60) as c:
            with pytest.raises(ExpertUnavailableError, match=rf"layer {layer} expert \d+: checksum mismatch "
                                                              rf"in experts-{layer:03d}.bin") as err:
                c.generate("hello", max_tokens=3)
            assert err.value.code == "expert_read_failed"  # the router's code, not a wrapper's
            assert c.health()["ok"] and proc.poll() is None
            with pytest.raises(ExpertUnavailableError, match="checksum mismatch"):
                c.logits([1, 2, 3])  # and again: a failed record is never served from the cache


def test_truncated_expert_file_is_refused_at_start(store_copy):
    store = Store(store_copy)
    rec = max(store.records.values(), key=lambda r: (r.file, r.offset))
    with open(store.path / rec.file, "r+b") as f:
        f.truncate(rec.offset + rec.nbytes // 2)
    r = _start(store_copy)
    assert r.returncode == 2 and "READY" not in r.stdout
    assert f"{rec.file}: layer {rec.layer} expert {rec.expert}" in r.stderr and "truncated" in r.stderr


def test_missing_files_are_refused_at_start(store_copy):
    (store_copy / "dense.safetensors").rename(store_copy / "moved")
    r = _start(store_copy)
    assert r.returncode == 2 and "dense weight file dense.safetensors is missing" in r.stderr
    assert "Traceback" not in r.stderr
    (store_copy / "moved").rename(store_copy / "dense.safetensors")
    name = Store(store_copy).record(Store(store_copy).moe_layers[0], 0).file
    (store_copy / name).unlink()
    r = _start(store_copy)
    assert r.returncode == 2 and f"expert file {name} is missing" in r.stderr


def test_manifest_that_does_not_match_the_files_is_refused(store_copy):
    m = json.loads((store_copy / "manifest.json").read_text())
    size = (store_copy / m["experts"][0]["file"]).stat().st_size
    m["experts"][0]["offset"] = size + 16384  # a record beyond the end of its file
    (store_copy / "manifest.json").write_text(json.dumps(m))
    r = _start(store_copy)
    assert r.returncode == 2 and f"the file has {size} bytes" in r.stderr
    m["experts"][0]["offset"] = 16384 * 3 + 1  # not aligned
    (store_copy / "manifest.json").write_text(json.dumps(m))
    assert "not 16384-aligned" in _start(store_copy).stderr
    m["experts"][0]["offset"] = 0
    m["experts"][0]["nbytes"] += 64  # the layout says otherwise
    (store_copy / "manifest.json").write_text(json.dumps(m))
    assert "does not match" in _start(store_copy).stderr
    del m["experts"][0]["checksum"]
    (store_copy / "manifest.json").write_text(json.dumps(m))
    r = _start(store_copy)
    assert r.returncode == 2 and "corrupt manifest" in r.stderr and "Traceback" not in r.stderr


def test_check_files_reads_no_data(store_copy, monkeypatch):
    """The start-up check is cheap: stat and headers, never the expert records themselves."""
    store = Store(store_copy)
    monkeypatch.setattr(Store, "read_record", lambda *a, **k: pytest.fail("read a record"))
    store.check_files()
    with open(store.path / store.record(store.moe_layers[0], 0).file, "ab") as f:
        f.write(b"\0" * 10)  # trailing bytes are harmless
    store.check_files()
    with pytest.raises(StoreError, match="outside the store"):
        store.records[(store.moe_layers[0], 0)] = store.record(store.moe_layers[0], 0).__class__(
            **{**store.record(store.moe_layers[0], 0).__dict__, "file": "../escape.bin"})
        store.check_files()


@pytest.mark.parametrize("family,key", [("gpt_oss", "sliding_window"), ("deepseek_v3", "qk_nope_head_dim"),
                                        ("glm4_moe", "use_qk_norm")])
def test_a_family_over_another_familys_config_is_refused_naming_the_key(store_copy, family, key):
    """A qwen3_moe store whose manifest names another supported family: refused at start naming
    the key that family needs and the family, without a traceback, whether the supervisor finds
    it (the budget's layer caches: a missing key, a null one) or compute building the model."""
    m = json.loads((store_copy / "manifest.json").read_text())
    m["architecture"] = m["config"]["model_type"] = family
    (store_copy / "manifest.json").write_text(json.dumps(m))
    r = _start(store_copy)
    assert r.returncode != 0 and "READY" not in r.stdout and "Traceback" not in r.stderr
    assert f"{key!r}, which a {family} model needs" in r.stderr


def _edit_manifest(store, edit) -> None:
    m = json.loads((store / "manifest.json").read_text())
    edit(m)
    (store / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("name,edit,says", [
    # a vocab_size past the embedding would let a request's token index beyond it (compute died)
    ("vocab", lambda m: m["config"].update(vocab_size=m["config"]["vocab_size"] * 10),
     "exceeds the embedding's"),
    # each token picking more experts than a layer has (every request failed after READY)
    ("top_k", lambda m: (m["config"].update(num_experts_per_tok=64), m["model"].update(top_k=64)),
     "picks 64 of"),
    # the model section and the config disagree (compute met a missing layer)
    ("layers", lambda m: m["config"].update(num_hidden_layers=m["config"]["num_hidden_layers"] + 4),
     "the manifest's model says num_hidden_layers"),
    # records past the model's experts (an index past the expert table at the first request)
    ("experts", lambda m: (m["config"].update(num_experts=m["model"]["n_experts"] // 2),
                           m["model"].update(n_experts=m["model"]["n_experts"] // 2)),
     "outside the model's MoE layers"),
    ("config", lambda m: m.update(config=[1, 2]), "not a JSON object"),
    ("dtype", lambda m: next(iter(m["layouts"].values()))["tensors"][0].update(dtype="float128"),
     "unknown dtype 'float128'"),
])
def test_a_manifest_disagreeing_with_itself_or_its_weights_is_refused_at_start(store_copy, name, edit, says):
    """Hand-edited or corrupt manifests that used to start and then fail each request (or crash
    compute): refused at start, naming what disagrees, without a traceback."""
    _edit_manifest(store_copy, edit)
    r = _start(store_copy)
    assert r.returncode == 2 and "READY" not in r.stdout, (name, r.stderr[-2000:])
    assert says in r.stderr and "Traceback" not in r.stderr, (name, r.stderr[-2000:])


def test_an_unreadable_tokenizer_is_refused_and_verify_names_it(store_copy):
    path = store_copy / "tokenizer" / "tokenizer.json"
    path.write_bytes(path.read_bytes()[:1000])
    r = _start(store_copy)
    assert r.returncode == 2 and "READY" not in r.stdout and "Traceback" not in r.stderr
    assert "tokenizer.json: unreadable tokenizer" in r.stderr
    problems = [msg for _, msg in Store(store_copy).verify()]
    assert any("tokenizer file tokenizer.json is corrupt" in p for p in problems), problems


def test_verify_names_a_record_whose_size_disagrees_with_its_layout(store_copy):
    _edit_manifest(store_copy, lambda m: m["experts"][0].update(nbytes=-1))
    problems = [msg for _, msg in Store(store_copy).verify()]
    assert any("-1 bytes in the manifest, its layout" in p for p in problems), problems
    assert not any("checksum" in p for p in problems), problems
