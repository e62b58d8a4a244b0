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
