"""MoEfication of the demo model: SmolLM2-135M-Instruct's FFNs split into experts that differ.

  python -m deltafin.tools.moefy [--experts 16] [--top-k 4] [--shared 32] [--out FILE]  (writes the MoE file)
  python -m deltafin.tools.moefy --evaluate FILE [--trace OUT.npz] [--json OUT.json]
                                 [--runtime-store STORE]          (held-out perplexity, routing)

Numbers are computed in numpy float32 from the dequantized GGUF (OpenBLAS; set
OPENBLAS_NUM_THREADS=1 on a shared machine): MLX's CPU matmuls are far slower here.

Each layer's FFN (SwiGLU, 1536 neurons) is cut into `experts` experts of whole 32-neuron blocks:
the down projection's Q4_1 groups (MLX affine group 32) run along the neurons, so a block is the
smallest slice that keeps the GGUF's quantized weights exactly. Blocks are clustered by
co-activation on calibration text (balanced k-means, then swaps that raise the output norm the
top-k experts of a token capture), and a linear router per layer (no bias, the Mixtral gate) is
trained to rank the experts by the norm of their output for the token. The shipped file
(configs/demo_moe.npz) holds per layer the blocks of each expert and the router, float16.

Mixtral weighs the chosen experts by a softmax over their k logits (they sum to 1), while the
dense FFN is the plain sum of the experts. The router is scaled so its logits spread little
(LOGIT_STD), which makes those weights close to 1/k, and the demo store multiplies each expert's
down projection by k (Q4_1 scales and biases are float16 values: times an integer below 2^13 they
stay exact in float32), so the MoE output is close to the sum of the chosen experts.

Text (offline, from the Python standard library): the docstrings of stdlib modules, their
classes and functions. A module whose crc32(name) % 5 == 0 is held out (perplexity and routing
statistics), every other module is calibration; the two sets share no module.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import pkgutil
import sys
import sysconfig
import tempfile
import time
import warnings
import zipfile
import zlib
from pathlib import Path

import numpy as np

from deltafin.runtime.cli import Help

BLOCK = 32  # neurons per down-projection quantization group
SEQ = 256  # tokens per calibration / held-out sequence
RUNTIME_SEQS = 2  # held-out sequences --runtime-store sends through the runtime
LOGIT_STD = 0.05  # the shipped router's logit spread: Mixtral's top-k softmax weights stay near 1/k
SHIPPED = Path(__file__).resolve().parent.parent / "configs" / "demo_moe.npz"
SHIPPED_SHA256 = "85ff9b86df11cc93685e0ce2592e6c99d6485122f784e821bb739063a1882b49"  # of the shipped file; moefy prints it when it writes one
SKIP_MODULES = ("antigravity", "this", "idlelib", "test", "tkinter", "turtle", "lib2to3", "ensurepip",
                "pydoc_data", "venv", "__main__", "__phello__", "_pyrepl")


class MoefyError(Exception):
    """The shipped MoE file is missing, corrupt or does not fit the model."""


# ---------------------------------------------------------------- text

def stdlib_docstrings(held_out: bool, max_chars: int) -> str:
    """Docstrings (module, public classes and functions, >= 200 chars) of the stdlib modules of
    one side of the split, in sorted module order, joined by blank lines, cut at max_chars."""
    stdlib = {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
    stdlib |= {f"{d}/lib-dynload" for d in stdlib}
    names = sorted(m.name for m in pkgutil.iter_modules() if getattr(m.module_finder, "path", None) in stdlib
                   and not m.name.startswith("_") and m.name not in SKIP_MODULES)
    docs, seen, total = [], set(), 0
    for name in names:
        if (zlib.crc32(name.encode()) % 5 == 0) != held_out:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module that does not import here is skipped
            continue
        objs = [mod] + [v for k, v in sorted(vars(mod).items()) if not k.startswith("_")
                        and (inspect.isclass(v) or inspect.isfunction(v))
                        and getattr(v, "__module__", None) == name]
        for obj in objs:
            doc = inspect.getdoc(obj) or ""
            if len(doc) >= 200 and doc not in seen:
                seen.add(doc)
                docs.append(doc)
                total += len(doc) + 2
        if total >= max_chars:
            break
    return "\n\n".join(docs)[:max_chars]


def token_sequences(tok, text: str, n_seqs: int) -> np.ndarray:
    """[n_seqs, SEQ] token ids: the text's tokens cut into consecutive sequences."""
    ids = np.array(tok.encode(text).ids, dtype=np.int32)
    n = min(n_seqs, len(ids) // SEQ)
    if n == 0:
        raise MoefyError(f"only {len(ids)} tokens of text, fewer than one sequence of {SEQ}")
    return ids[:n * SEQ].reshape(n, SEQ)


# ---------------------------------------------------------------- dense forward (numpy, float32)

def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(t, theta):
    """Half-split rotary embedding (Hugging Face llama) of t [B, heads, S, hd], positions from 0."""
    hd = t.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.arange(t.shape[2])[:, None] * inv[None]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    a, b = t[..., :hd // 2], t[..., hd // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


class Dense:
    """The dequantized llama (float32 numpy: OpenBLAS matmuls) run layer by layer on a batch of
    sequences."""

    def __init__(self, weights: dict, cfg: dict):
        self.w = weights
        self.cfg = cfg
        self.n_layers = cfg["num_hidden_layers"]
        self.eps = cfg["rms_norm_eps"]

    def embed(self, ids):
        return self.w["model.embed_tokens.weight"][ids]

    def attention(self, i: int, x):
        """x + causal self-attention of layer i on x [B, S, H]."""
        c, w, p = self.cfg, self.w, f"model.layers.{i}."
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        b, s, _ = x.shape
        h = rms_norm(x, w[p + "input_layernorm.weight"], self.eps)
        q, k, v = ((h @ w[f"{p}self_attn.{n}_proj.weight"].T).reshape(b, s, heads, hd).transpose(0, 2, 1, 3)
                   for n, heads in (("q", nh), ("k", nkv), ("v", nkv)))
        q, k = rope(q, c["rope_theta"]), rope(k, c["rope_theta"])
        k, v = (np.repeat(t, nh // nkv, axis=1) for t in (k, v))
        att = q @ k.transpose(0, 1, 3, 2) * np.float32(hd ** -0.5)
        att = np.where(np.tri(s, dtype=bool), att, np.float32(-np.inf))
        att = np.exp(att - att.max(-1, keepdims=True))
        o = (att / att.sum(-1, keepdims=True)) @ v
        return x + o.transpose(0, 2, 1, 3).reshape(b, s, -1) @ w[p + "self_attn.o_proj.weight"].T

    def ffn_input(self, i: int, x):
        return rms_norm(x, self.w[f"model.layers.{i}.post_attention_layernorm.weight"], self.eps)

    def neurons(self, i: int, h):
        """SwiGLU activations [..., I] of layer i's FFN on its input h."""
        p = f"model.layers.{i}.mlp."
        g = h @ self.w[p + "gate_proj.weight"].T
        return g / (1 + np.exp(-g)) * (h @ self.w[p + "up_proj.weight"].T)

    def down(self, i: int, a):
        return a @ self.w[f"model.layers.{i}.mlp.down_proj.weight"].T

    def nll(self, x, ids) -> np.ndarray:
        """Per-token negative log-likelihood [B, S-1] of ids[:, 1:] from the last hidden state x."""
        h = rms_norm(x, self.w["model.norm.weight"], self.eps)
        head = self.w["lm_head.weight" if "lm_head.weight" in self.w else "model.embed_tokens.weight"]
        from deltafin.tools.eval import next_token_scores
        # one sequence at a time: [S, vocab] logits
        return np.stack([next_token_scores(h[r] @ head.T, ids[r])[0] for r in range(x.shape[0])])


# ---------------------------------------------------------------- experts and router

def block_gram(w_down: np.ndarray) -> np.ndarray:
    """[n_blocks, 32, 32] Gram matrices of the down projection's column blocks."""
    nb = w_down.shape[1] // BLOCK
    wb = w_down.reshape(w_down.shape[0], nb, BLOCK).transpose(1, 0, 2)
    return np.einsum("boi,boj->bij", wb, wb)


def output_norms(a: np.ndarray, w_down: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """[T, len(groups)] norm of each group's output W_down[:, cols] @ a[cols] for each token;
    groups [G, blocks] lists the 32-neuron blocks of each group."""
    out = np.empty((a.shape[0], len(groups)), np.float32)
    for g, blocks in enumerate(groups):
        cols = (np.asarray(blocks)[:, None] * BLOCK + np.arange(BLOCK)).ravel()
        w = w_down[:, cols]
        ag = a[:, cols]
        out[:, g] = np.sqrt(np.maximum(((ag @ (w.T @ w)) * ag).sum(1), 0))
    return out


def captured(scores: np.ndarray, assign: np.ndarray, n_experts: int, top_k: int) -> float:
    """Mean share of the block scores a token's top-k experts hold (experts = sum of their blocks)."""
    onehot = np.eye(n_experts, dtype=np.float32)[assign]  # [blocks, E]
    es = scores @ onehot
    top = np.partition(es, n_experts - top_k, axis=1)[:, n_experts - top_k:].sum(1)
    return float((top / es.sum(1)).mean())


def balanced_assign(sim: np.ndarray, size: int) -> np.ndarray:
    """Greedy: the most similar (block, expert) pairs first, each expert taking `size` blocks."""
    assign = np.full(sim.shape[0], -1, np.int64)
    room = np.full(sim.shape[1], size)
    for flat in np.argsort(-sim, axis=None):
        b, e = divmod(int(flat), sim.shape[1])
        if assign[b] < 0 and room[e] > 0:
            assign[b], room[e] = e, room[e] - 1
    return assign


def cluster_blocks(scores: np.ndarray, n_experts: int, top_k: int, rng, swap_tokens: int = 2048) -> np.ndarray:
    """Assigns the blocks (columns of scores [T, blocks]) to n_experts equal groups: balanced
    k-means on each block's standardized co-activation profile, then one pass of pairwise swaps
    that raise `captured` on swap_tokens of the tokens. Returns [blocks] expert ids."""
    nb = scores.shape[1]
    size = nb // n_experts
    prof = scores / scores.sum(1, keepdims=True)
    prof = (prof - prof.mean(0)) / (prof.std(0) + 1e-9)
    feats = prof.T / np.sqrt(prof.shape[0])  # [blocks, T], unit-ish rows: dot = correlation
    best, best_val = None, -1.0
    for _ in range(4):
        cent = feats[rng.choice(nb, n_experts, replace=False)]
        for _ in range(15):
            assign = balanced_assign(feats @ cent.T, size)
            cent = np.stack([feats[assign == e].mean(0) for e in range(n_experts)])
        val = captured(scores, assign, n_experts, top_k)
        if val > best_val:
            best, best_val = assign.copy(), val
    assign = best
    sub = scores[rng.choice(len(scores), min(swap_tokens, len(scores)), replace=False)]
    es = sub @ np.eye(n_experts, dtype=np.float32)[assign]
    total = es.sum(1)

    def value(es):
        return float((np.partition(es, n_experts - top_k, axis=1)[:, n_experts - top_k:].sum(1) / total).mean())

    cur = value(es)
    for i in range(nb):
        for j in range(i + 1, nb):
            a, b = assign[i], assign[j]
            if a == b:
                continue
            d = sub[:, j] - sub[:, i]
            es[:, a] += d
            es[:, b] -= d
            val = value(es)
            if val > cur + 1e-6:
                cur, assign[i], assign[j] = val, b, a
            else:
                es[:, a] -= d
                es[:, b] += d
    return assign


def train_router(x: np.ndarray, target: np.ndarray, top_k: int, steps: int = 100, lr: float = 2e-2) -> np.ndarray:
    """Gate [E, H] (no bias) ranking the experts like target [T, E]: ridge regression on the
    per-token standardized target, then Adam on a cross-entropy towards the target's top-k."""
    y = (target - target.mean(1, keepdims=True)) / (target.std(1, keepdims=True) + 1e-9)
    xtx = x.T.astype(np.float64) @ x + 1e-2 * len(x) * np.eye(x.shape[1])
    gate = np.linalg.solve(xtx, x.T.astype(np.float64) @ y).T.astype(np.float32)
    n_experts = target.shape[1]
    kth = np.partition(target, n_experts - top_k, axis=1)[:, n_experts - top_k][:, None]
    want = (target >= kth).astype(np.float32) / top_k
    m, v = np.zeros_like(gate), np.zeros_like(gate)
    for t in range(1, steps + 1):
        logits = x @ gate.T
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        grad = (p - want).T @ x / len(x)
        m = 0.9 * m + 0.1 * grad
        v = 0.999 * v + 0.001 * grad * grad
        gate -= lr * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    return gate


def moefy(dense: Dense, seqs: np.ndarray, n_experts: int, top_k: int, seed: int = 0, log=print,
          shared: int = 0) -> dict:
    """Per layer: the blocks of each expert [L, E, blocks/E] and the router [L, E, H] (float16,
    scaled to LOGIT_STD), from the dense model's activations on seqs [B, S]. With shared > 0 also
    the `shared` blocks of largest mean output norm [L, shared], always on: the experts and the
    router are made from the other blocks."""
    rng = np.random.default_rng(seed)
    inter = dense.cfg["intermediate_size"]
    if inter % BLOCK or not 0 <= shared < inter // BLOCK or (inter // BLOCK - shared) % n_experts:
        raise MoefyError(f"{inter} neurons less {shared} shared blocks do not split into {n_experts} experts "
                         f"of whole {BLOCK}-neuron blocks")
    x = dense.embed(seqs)
    experts, gates, always = [], [], []
    for i in range(dense.n_layers):
        t0 = time.time()
        x = dense.attention(i, x)
        h = dense.ffn_input(i, x)
        a = dense.neurons(i, h)
        hn, an = h.reshape(-1, h.shape[-1]), a.reshape(-1, a.shape[-1])
        w_down = dense.w[f"model.layers.{i}.mlp.down_proj.weight"]
        blocks = np.arange(inter // BLOCK)[:, None]
        scores = output_norms(an, w_down, blocks)
        on = np.sort(np.argsort(-scores.mean(0), kind="stable")[:shared])
        routed = np.setdiff1d(np.arange(len(blocks)), on)
        scores = scores[:, routed]
        assign = cluster_blocks(scores, n_experts, top_k, rng)
        groups = np.stack([routed[assign == e] for e in range(n_experts)])
        always.append(on)
        target = output_norms(an, w_down, groups)
        gate = train_router(hn, target, top_k)
        logits = hn @ gate.T
        gate *= LOGIT_STD / logits.std()
        experts.append(groups)
        gates.append(gate.astype(np.float16))
        pick = np.argpartition(-logits, top_k - 1, axis=1)[:, :top_k]
        best = np.argpartition(-target, top_k - 1, axis=1)[:, :top_k]
        recall = np.mean([len(set(p) & set(b)) for p, b in zip(pick, best)]) / top_k
        log(f"layer {i}: captured (oracle top-{top_k}) {captured(scores, assign, n_experts, top_k):.3f}, "
            f"router recall {recall:.3f} ({time.time() - t0:.1f}s)")
        x = x + dense.down(i, a)
    moe = {"experts": np.stack(experts).astype(np.int16), "gates": np.stack(gates),
           "top_k": np.int64(top_k), "block": np.int64(BLOCK)}
    if shared:
        moe["shared"] = np.stack(always).astype(np.int16)
    return moe


# ---------------------------------------------------------------- the shipped file

def load_moe(path=None, n_layers: int | None = None, hidden: int | None = None,
             intermediate: int | None = None) -> dict:
    """The MoE file (default: the shipped one, whose sha256 is checked), checked against the
    model's shape: the experts of every layer partition its blocks."""
    path = Path(path or SHIPPED)
    if path == SHIPPED and hashlib.sha256(path.read_bytes()).hexdigest() != SHIPPED_SHA256:
        raise MoefyError(f"{path} does not have the sha256 this deltafin ships ({SHIPPED_SHA256}): reinstall it")
    try:
        with np.load(path, allow_pickle=False) as z:
            moe = {k: z[k] for k in ("experts", "gates", "top_k", "block")}
            if "shared" in z.files:
                moe["shared"] = z["shared"]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise MoefyError(f"{path}: not a MoE file from deltafin.tools.moefy: {e}") from None
    ex, gates = moe["experts"], moe["gates"]
    n_l, n_e, per = ex.shape
    if gates.shape[:2] != (n_l, n_e) or int(moe["block"]) != BLOCK or not 1 <= int(moe["top_k"]) <= n_e:
        raise MoefyError(f"{path}: inconsistent shapes {ex.shape}, {gates.shape}")
    if n_layers is not None and (n_l, gates.shape[2]) != (n_layers, hidden):
        raise MoefyError(f"{path}: made for {n_l} layers of width {gates.shape[2]}, the model has {n_layers} of {hidden}")
    on = moe.get("shared", np.zeros((n_l, 0), np.int16))
    if on.shape[0] != n_l:
        raise MoefyError(f"{path}: shared blocks for {on.shape[0]} layers, experts for {n_l}")
    if intermediate is not None and any(sorted([*r.ravel(), *s]) != list(range(intermediate // BLOCK))
                                        for r, s in zip(ex, on)):
        raise MoefyError(f"{path}: the experts (and shared blocks) of a layer do not partition its "
                         f"{intermediate // BLOCK} blocks")
    return moe


def neuron_columns(blocks) -> np.ndarray:
    """Neuron indices of an expert's blocks, in block order."""
    return (np.asarray(blocks)[:, None] * BLOCK + np.arange(BLOCK)).ravel()


# ---------------------------------------------------------------- evaluation

def routed_weights(logits: np.ndarray, k: int, shared: bool):
    """The chosen experts [T, k] and their weights as the demo store computes them. Without shared
    blocks (a Mixtral store): the top-k logits, a softmax over those k, times k. With them (a
    Qwen2-MoE store): a softmax over all E experts, the k best kept unnormalised, times E (the
    store multiplies each routed expert's down projection by E, so with the router's small logit
    spread a chosen expert's weight stays near 1, as the dense FFN's plain sum has it)."""
    inds = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    if shared:
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        return inds, np.take_along_axis(p, inds, axis=1) * logits.shape[1]
    top = np.take_along_axis(logits, inds, axis=1)
    wts = np.exp(top - top.max(1, keepdims=True))
    return inds, wts / wts.sum(1, keepdims=True) * k


def moe_ffn(dense: Dense, i: int, h, moe: dict, ids_out: list):
    """Layer i's FFN as the demo MoE computes it (`routed_weights`, `weighted_ffn`); the chosen
    ids [tokens, k] are appended to ids_out."""
    logits = h.reshape(-1, h.shape[-1]) @ moe["gates"][i].astype(np.float32).T  # [T, E]
    inds, wts = routed_weights(logits, int(moe["top_k"]), "shared" in moe)
    ids_out.append(inds)
    return weighted_ffn(dense, i, h, moe["experts"][i], inds, wts)


def weighted_ffn(dense: Dense, i: int, h, experts: np.ndarray, inds: np.ndarray, wts: np.ndarray):
    """Layer i's FFN with each token's chosen experts inds [T, k] weighted by wts [T, k], plus the
    blocks of no expert (the shared ones: weight 1, the store's shared expert scaled by 2 behind
    a sigmoid gate of 0) where the file has them."""
    per_expert = np.zeros((len(inds), len(experts) + 1), np.float32)  # the last column: shared blocks
    per_expert[:, -1] = 1
    np.put_along_axis(per_expert, inds, wts, axis=1)
    owner = np.full(dense.cfg["intermediate_size"], len(experts), np.int64)
    for e, blocks in enumerate(experts):
        owner[neuron_columns(blocks)] = e
    return dense.down(i, dense.neurons(i, h) * per_expert[:, owner].reshape(*h.shape[:-1], -1))


def evaluate(dense: Dense, seqs: np.ndarray, moe: dict | None) -> tuple[np.ndarray, np.ndarray | None]:
    """Teacher-forced NLL [B, S-1] of the dense model (moe None) or the MoE; with the MoE also the
    routing [B*S, L, k]."""
    x, routing = dense.embed(seqs), []
    for i in range(dense.n_layers):
        x = dense.attention(i, x)
        h = dense.ffn_input(i, x)
        x = x + (dense.down(i, dense.neurons(i, h)) if moe is None else moe_ffn(dense, i, h, moe, routing))
    nll = dense.nll(x, seqs)
    return nll, (np.stack(routing, axis=1) if moe is not None else None)


def runtime_nll(store_path, seqs: np.ndarray, budget: str = "1GiB") -> np.ndarray:
    """Teacher-forced NLL [B, S-1] of seqs through the running runtime (a supervisor on the
    store, logits requests), float64 log-softmax of its float32 logits."""
    from deltafin.client import Client
    from deltafin.tools.eval import next_token_scores
    from deltafin.tools.run import running_supervisor
    out = []
    with running_supervisor(store_path, budget, ["--max-context", str(2 * SEQ)]) as (ep, _):
        with Client(ep, timeout=600) as c:
            for row in seqs:
                out.append(next_token_scores(c.logits([int(t) for t in row]), row)[0])
    return np.stack(out)


def reuse_per_layer(ids: np.ndarray, lengths) -> np.ndarray:
    """Mean share of a token's k experts that the previous token of the same sequence also used,
    per layer; ids [T, L, k]."""
    k = ids.shape[2]
    first = np.zeros(len(ids), bool)
    first[np.cumsum([0, *lengths[:-1]])] = True
    prev, cur = ids[:-1][~first[1:]], ids[1:][~first[1:]]
    same = (cur[..., :, None] == prev[..., None, :]).any(-1).sum(-1)  # [pairs, L]
    return same.mean(0) / k


def routing_stats(ids: np.ndarray, lengths, n_experts: int) -> dict:
    """Per-layer expert-use shares, previous-token reuse against k/E, and replay hit rates at 25%."""
    from deltafin.tools.replay import n_slots_for, replay
    k = ids.shape[2]
    use = np.stack([np.bincount(ids[:, i].ravel(), minlength=n_experts) for i in range(ids.shape[1])])
    share = use / use.sum(1, keepdims=True)
    reuse = reuse_per_layer(ids, lengths)
    slots = n_slots_for(0.25, ids.shape[1], n_experts)
    hits = {p: round(float(replay(ids, slots, p, n_experts=n_experts)["hit_rate"]), 4)
            for p in ("lru", "predictive", "belady")}
    ent = -(share * np.log(np.maximum(share, 1e-12))).sum(1) / np.log(n_experts)
    return {"use_share_min": share.min(1).round(4).tolist(), "use_share_max": share.max(1).round(4).tolist(),
            "use_entropy_frac": ent.round(4).tolist(), "reuse": reuse.round(4).tolist(),
            "reuse_mean": round(float(reuse.mean()), 4), "random_reuse": round(k / n_experts, 4),
            "hit_rate_25pct": hits, "slots_25pct": slots}


# ---------------------------------------------------------------- CLI

def _setup():
    from tokenizers import Tokenizer

    from deltafin.tools.demo_model import GGUFModel, fetch_gguf, write_tokenizer
    g = GGUFModel(fetch_gguf())
    cfg = g.hf_config("llama")
    with tempfile.TemporaryDirectory() as td:
        tok = Tokenizer.from_file(str(write_tokenizer(g, Path(td))[0]))
    return Dense(g.dense_weights(), cfg), tok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="python -m deltafin.tools.moefy",
                                description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=16, help="experts per layer")
    p.add_argument("--top-k", type=int, default=4, help="experts per token")
    p.add_argument("--shared", type=int, default=32,
                   help="blocks of each layer always on: a shared expert (0: none, a Mixtral store)")
    p.add_argument("--calib-seqs", type=int, default=24, help=f"calibration sequences of {SEQ} tokens")
    p.add_argument("--eval-seqs", type=int, default=16, help=f"held-out sequences of {SEQ} tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help=f"write the MoE file here (the shipped one: {SHIPPED})")
    p.add_argument("--evaluate", metavar="MOE", help="measure this MoE file on the held-out text instead")
    p.add_argument("--trace", help="with --evaluate: write the held-out routing as a trace (docs/TRACES.md)")
    p.add_argument("--json", help="with --evaluate: write the figures here")
    p.add_argument("--runtime-store", help="with --evaluate: also the perplexity through the runtime on this store "
                                           "(deltafin-synth demo OUT --moe --moe-file MOE)")
    a = p.parse_args(argv)
    log = lambda m: print(f"moefy: {m}", file=sys.stderr, flush=True)
    dense, tok = _setup()
    if a.evaluate:
        return _evaluate(dense, tok, a, log)
    seqs = token_sequences(tok, stdlib_docstrings(False, a.calib_seqs * SEQ * 6), a.calib_seqs)
    log(f"calibration: {seqs.size} tokens")
    moe = moefy(dense, seqs, a.experts, a.top_k, a.seed, log, a.shared)
    out = Path(a.out or SHIPPED)
    np.savez_compressed(out, **moe)
    log(f"wrote {out} ({out.stat().st_size} bytes, sha256 {hashlib.sha256(out.read_bytes()).hexdigest()})")
    return 0


def _evaluate(dense, tok, a, log) -> int:
    from deltafin.runtime.traces import save_trace
    seqs = token_sequences(tok, stdlib_docstrings(True, a.eval_seqs * SEQ * 6), a.eval_seqs)
    moe = load_moe(a.evaluate)
    t0 = time.time()
    nll_d, _ = evaluate(dense, seqs, None)
    nll_m, ids = evaluate(dense, seqs, moe)
    n_e, k = moe["gates"].shape[1], int(moe["top_k"])
    lengths = [SEQ] * len(seqs)
    n_on = moe["shared"].shape[1] if "shared" in moe else 0
    res = {"experts": n_e, "top_k": k, "shared_blocks": n_on, "held_out_tokens": int(seqs.size),
           "ffn_share": round((n_on + k * moe["experts"].shape[2]) * BLOCK / dense.cfg["intermediate_size"], 4),
           "ppl_dense": round(float(np.exp(nll_d.mean())), 3), "ppl_moe": round(float(np.exp(nll_m.mean())), 3),
           **routing_stats(ids, lengths, n_e)}
    res["ppl_ratio"] = round(res["ppl_moe"] / res["ppl_dense"], 4)
    if a.runtime_store:  # the runtime on CPU is slow: its first RUNTIME_SEQS sequences, both ways
        n = RUNTIME_SEQS
        res["runtime_seqs"] = n
        res["ppl_runtime"] = round(float(np.exp(runtime_nll(a.runtime_store, seqs[:n]).mean())), 3)
        res["ppl_moe_same_seqs"] = round(float(np.exp(nll_m[:n].mean())), 3)
    log(f"held-out {seqs.size} tokens: ppl dense {res['ppl_dense']}, MoE {res['ppl_moe']} "
        f"(x{res['ppl_ratio']}); reuse {res['reuse_mean']} vs k/E {res['random_reuse']}; "
        f"hit rate at 25% {res['hit_rate_25pct']} ({time.time() - t0:.0f}s)")
    if a.trace:
        save_trace(a.trace, ids.astype(np.uint8), np.array(lengths), np.array([f"heldout-{i}" for i in range(len(seqs))]))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
