"""Synthetic models for tests and benchmarks (no downloads, no torch).

  deltafin-synth tiny ARCH OUT    tiny random Hugging Face checkpoint (config, safetensors, tokenizer);
                                  --set KEY=JSON (repeatable) overrides a config key before the shapes follow
  deltafin-synth bench PRESET OUT full-size random deltafin store written at disk speed
  deltafin-synth demo OUT         the demo store built from SmolLM2-135M-Instruct (tools/demo_model.py)

All tensor names and shapes come from tensor_shapes(config) (tools/synth_shapes.py): one small
function per architecture, shared by both subcommands, checked against transformers in
tests/test_synth.py; the configs and presets are tools/synth_configs.py.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np
from deltafin.runtime import archinfo
from deltafin.runtime.cli import Help
from deltafin.runtime.tensorfile import SafetensorsSpool
from deltafin.tools.convert import progress_bar
from deltafin.tools.demo_model import add_demo_parser
from deltafin.tools.synth_configs import (BOS_ID, EOS_ID, INIT_STD, PRESETS, hub_config, published,
                                          rope_parameters)
from deltafin.tools.synth_shapes import tensor_shapes

TINY_ARCHS = tuple(archinfo.ARCHS)


# ---------------------------------------------------------------------------------------------
# Random values
# ---------------------------------------------------------------------------------------------

def _is_norm(name: str) -> bool:
    return name.endswith(("norm.weight", "norm_weight"))


def _is_router(name: str) -> bool:
    return name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".mlp.router.weight"))


def init_std(name: str, shape, in_first: bool = False) -> float:
    """Unit-scale init: std 1/sqrt(fan_in) for matrices (transformers' 0.02 at real widths) and 1 for
    embeddings; in_first: fused experts are [E, in, out] (gpt-oss). Plain 0.02 on a 128-wide model lets attention swamp the token signal: routing piles
    onto a few experts and the experts hardly move the logits, which makes weak test references."""
    if "embed_tokens" in name:
        return 1.0
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # fused [E, out, in]
        return 1.0 / math.sqrt(shape[1] if in_first else shape[-1])  # gpt-oss's: [E, in, out]
    if len(shape) == 2 or name.endswith("conv1d.weight"):
        return 1.0 / math.sqrt(shape[-1])
    if name.endswith("e_score_correction_bias"):
        return 0.1  # transformers uses zeros; nonzero exercises the selection-only bias path
    return INIT_STD  # linear biases (transformers: zeros) so a dropped bias shows in the outputs


def init_tensor(name: str, shape, seed: int, in_first: bool = False, hf_std: float | None = None) -> np.ndarray:
    """float32 values for one tensor; RMSNorm weights are 1. in_first: see init_std. hf_std: as
    transformers initializes a model it builds (`initializer_range`): every weight normal with
    this std, biases 0, instead of init_std's unit scale."""
    if _is_norm(name):
        return np.ones(shape, np.float32)
    if hf_std is not None and name.endswith("bias"):
        return np.zeros(shape, np.float32)
    # per-tensor stream: the values do not depend on the writing order or the sharding
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    std = init_std(name, shape, in_first) if hf_std is None else hf_std
    return rng.normal(0.0, std, size=shape).astype(np.float32)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    return to_bf16_bits(x) if dtype == "bfloat16" else x.astype(dtype)




def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> int:
    """{name: (dtype_name, array)} -> a safetensors file transformers accepts; returns data bytes."""
    spool = SafetensorsSpool(path, metadata={"format": "pt"})
    for name, (dt, arr) in tensors.items():
        spool.add(name, dt, arr.shape, arr)
    spool.finish()
    return sum(arr.nbytes for _, arr in tensors.values())


def _natural(name: str):
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name)]


# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE trained on a few sentences, padded with reserved tokens to the vocab
# ---------------------------------------------------------------------------------------------

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2 = bos, chat start, eos
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_CORPUS = """The quick brown fox jumps over the lazy dog. A mixture of experts routes every token to a few
experts out of many. Experts are streamed from the solid state drive into shared memory when they are needed.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
Once upon a time there was a small model that learned to count: one, two, three, four, five, six, seven.
def main():\n    print("hello")\n    return 0\nThe weather is nice and the sky is blue; the sea is calm.
Numbers 0123456789 and symbols (+-*/=<>[]{}) appear in code, in maths and in tables of results.""".splitlines()


def write_tokenizer(out: Path, vocab: int) -> list[Path]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if vocab < 256 + len(SPECIALS):
        raise SystemExit(f"--vocab must be at least {256 + len(SPECIALS)} for a byte-level tokenizer")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=list(SPECIALS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=1)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    n = tok.get_vocab_size()
    if n < vocab:  # the corpus ran out of merges: fill the rest so ids cover the embedding exactly
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab - n)])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    bos, _, eos = SPECIALS
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": bos,
        "unk_token": None, "add_bos_token": False, "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE}, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": bos, "eos_token": eos, "pad_token": bos}, indent=1))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}, indent=1))
    return [out / f for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                              "generation_config.json")]


# ---------------------------------------------------------------------------------------------
# (a) tiny checkpoints
# ---------------------------------------------------------------------------------------------

def _tensor_dtype(name: str, dtype: str) -> str:
    # e_score_correction_bias stays float32, as in the published DeepSeek-V3 checkpoints (and
    # what mlx-lm keeps as stored: the router bias, KDA's A_log and dt_bias)
    return "float32" if name.endswith(("e_score_correction_bias", "A_log", "dt_bias")) else dtype


def write_checkpoint(out: Path, config: dict, dtype: str, seed: int, shards: int = 1, init: str = "unit") -> Path:
    """config.json + model.safetensors (or N shards with an index) + tokenizer files. init: "unit"
    (init_std) or "hf" (transformers' initializer_range, as a checkpoint it makes)."""
    hf_std = config.get("initializer_range", 0.02) if init == "hf" else None
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), *out.glob("model.safetensors.index.json")]:
        old.unlink()  # a stale shard from an earlier run would be loaded too
    shapes = tensor_shapes(config)
    names = sorted(shapes, key=_natural)
    sizes = [int(np.prod(shapes[n])) * np.dtype(np.float32 if _tensor_dtype(n, dtype) == "float32"
                                                 else np.float16).itemsize for n in names]
    shards = max(1, min(shards, len(names)))
    total, groups, acc = sum(sizes), [[] for _ in range(shards)], 0
    for n, size in zip(names, sizes):  # contiguous runs of about total/shards bytes each
        groups[min(shards - 1, acc * shards // total)].append(n)
        acc += size
    groups = [g for g in groups if g]
    weight_map = {}
    for i, group in enumerate(groups):
        fname = "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for n in group:
            dt = _tensor_dtype(n, dtype)
            tensors[n] = (dt, _cast(init_tensor(n, shapes[n], seed, config.get("model_type") == "gpt_oss", hf_std), dt))
        write_safetensors(out / fname, tensors)
        weight_map.update({n: fname for n in group})
    if len(groups) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(out, archinfo.text_model(config)["vocab_size"])
    return out


def for_mlx_lm(path) -> Path:
    """A tiny checkpoint as mlx-lm 0.32.2 reads it: gpt-oss's fused experts split into mlx-lm's own
    layout, experts.{gate,up,down}_proj.weight [E, out, in] and .bias [E, out] (its sanitize reads
    the fused tensors only as OpenAI's mxfp4 blocks), written once to a sibling folder; every other
    family's checkpoint as it is."""
    import shutil

    import mlx.core as mx
    path = Path(path)
    if json.loads((path / "config.json").read_text())["model_type"] != "gpt_oss":
        return path
    out = path.parent / f"{path.name}-mlx"
    if not out.exists():
        shutil.copytree(path, out)
        for f in out.glob("model*.safetensors"):
            w = mx.load(str(f))
            for k in [k for k in w if k.endswith("experts.gate_up_proj")]:
                e = k[: -len("gate_up_proj")]
                gu, gub = w.pop(k).swapaxes(-1, -2), w.pop(f"{e}gate_up_proj_bias")
                w.update({f"{e}gate_proj.weight": gu[:, 0::2], f"{e}up_proj.weight": gu[:, 1::2],
                          f"{e}gate_proj.bias": gub[:, 0::2], f"{e}up_proj.bias": gub[:, 1::2],
                          f"{e}down_proj.weight": w.pop(f"{e}down_proj").swapaxes(-1, -2),
                          f"{e}down_proj.bias": w.pop(f"{e}down_proj_bias")})
            mx.save_safetensors(str(f), {k: mx.contiguous(v) for k, v in w.items()}, metadata={"format": "pt"})
    return out


def with_overrides(config: dict, overrides: dict | None) -> dict:
    """config updated with overrides, keeping the paired spellings in step: rope_parameters (transformers 5)
    with rope_theta + rope_scaling (mlx-lm), num_experts with num_local_experts (qwen3_moe), and
    num_hidden_layers with max_window_layers (qwen). An override given for both spellings is kept as given."""
    if not overrides:
        return dict(config)
    if {"dtype", "torch_dtype"} & overrides.keys():
        raise ValueError("set the checkpoint dtype with dtype=, not overrides (it decides the tensors' dtype)")
    c = {**config, **overrides}
    if "rope_parameters" in overrides:
        rp = dict(overrides["rope_parameters"] or {})
        rp.setdefault("rope_theta", c["rope_theta"])
        c["rope_parameters"] = rp
        if "rope_theta" not in overrides:
            c["rope_theta"] = rp["rope_theta"]
        if "rope_scaling" not in overrides:
            kind = rp.get("rope_type") or rp.get("type") or "default"
            c.pop("rope_scaling", None)
            if kind != "default":
                c["rope_scaling"] = {"type": kind, **{k: v for k, v in rp.items()
                                                      if k not in ("rope_type", "type", "rope_theta")}}
    elif {"rope_scaling", "rope_theta"} & overrides.keys():
        c["rope_parameters"] = rope_parameters(c["rope_theta"], c.get("rope_scaling"))
    if c["model_type"] == "qwen3_moe":
        for a, b in (("num_experts", "num_local_experts"), ("num_local_experts", "num_experts")):
            if a in overrides and b not in overrides:
                c[b] = overrides[a]
    if "num_hidden_layers" in overrides and "max_window_layers" in c and "max_window_layers" not in overrides:
        c["max_window_layers"] = overrides["num_hidden_layers"]
    return c


def tiny(arch: str, out, *, layers: int | None = None, experts: int = 8, top_k: int = 2, hidden: int = 128,
         moe_intermediate: int = 128, vocab: int = 512, dtype: str = "float32", seed: int = 0, shards: int = 1,
         q_lora_rank: int | None = None, overrides: dict | None = None, init: str = "unit") -> Path:
    """A tiny random checkpoint. overrides update the hub config before the tensor shapes are derived from it
    (any config key: head_dim, tie_word_embeddings, mlp_only_layers, rope_parameters, n_group, ...).
    init: see write_checkpoint."""
    if arch not in TINY_ARCHS:
        raise SystemExit(f"unknown architecture {arch!r}; choose from {', '.join(TINY_ARCHS)}")
    if not 1 <= top_k <= experts:
        raise SystemExit(f"--top-k must be between 1 and --experts ({experts})")
    if hidden % 64 or moe_intermediate % 64:
        print("warning: --hidden/--moe-intermediate not multiples of 64: some weights will not fit "
              "4-bit group-64 quantization", file=sys.stderr)
    if layers is None:  # deepseek's, glm's and kimi's first layer is dense: keep two MoE layers everywhere
        layers = 3 if arch.startswith(("deepseek", "kimi")) or arch == "glm4_moe" else 2
    config = hub_config(arch, layers=layers, experts=experts, top_k=top_k, hidden=hidden,
                        moe_intermediate=moe_intermediate, vocab=vocab, dtype=dtype, q_lora_rank=q_lora_rank)
    return write_checkpoint(Path(out), published(with_overrides(config, overrides)), dtype, seed, shards, init)


# ---------------------------------------------------------------------------------------------
# (b) benchmark stores: random packed 4-bit data, no float weights ever materialized
# ---------------------------------------------------------------------------------------------

class _RandomQuant:
    """Random MLX-affine quantized tensors cut from pre-generated pools, so output runs at disk speed.

    Codes are uniform random; scales/biases centre each group on zero with about the given std.
    """

    POOL_BYTES = 64 << 20
    POOL_GROUPS = 1 << 20

    def __init__(self, seed: int, bits: int, group_size: int, dtype: str):
        self.rng = np.random.default_rng(seed)
        self.bits, self.group_size, self.dtype = bits, group_size, dtype
        self.codes = np.frombuffer(self.rng.bytes(self.POOL_BYTES), np.uint32)
        self.jitter = self.rng.uniform(0.8, 1.25, self.POOL_GROUPS).astype(np.float32)
        self._groups: dict[float, tuple[np.ndarray, np.ndarray]] = {}

    def _group_pool(self, std: float):
        if std not in self._groups:  # uniform codes 0..L have std ~ L/sqrt(12)
            levels = (1 << self.bits) - 1
            scale = std * math.sqrt(12) / levels * self.jitter
            self._groups[std] = (_cast(scale, self.dtype), _cast(-0.5 * levels * scale, self.dtype))
        return self._groups[std]

    def _start(self, pool_len: int, n: int) -> int | None:
        """A random window of n items in a pool, or None when the pool is too small to vary it."""
        return int(self.rng.integers(0, pool_len - n)) if 2 * n <= pool_len else None

    def tensor(self, out: int, inp: int, std: float) -> dict[str, np.ndarray]:
        words, groups = inp * self.bits // 32, inp // self.group_size
        nw, ng = out * words, out * groups
        i = self._start(len(self.codes), nw)
        # only embeddings and lm_head outgrow the pools: generate those directly
        w = self.codes[i:i + nw] if i is not None else np.frombuffer(self.rng.bytes(nw * 4), np.uint32)
        scales, biases = self._group_pool(std)
        i = self._start(len(scales), ng)
        sel = slice(i, i + ng) if i is not None else self.rng.integers(0, len(scales), ng)
        s, b = scales[sel], biases[sel]
        return {"weight": w.reshape(out, words), "scales": s.reshape(out, groups),
                "biases": b.reshape(out, groups)}


def _quantize_dense(name: str, shape, group_size: int, config: dict) -> bool:
    """mlx-lm quantizes every Linear/Embedding whose input width fits the groups; routers stay float, and so
    does deepseek_v3's kv_b_proj, which mlx-lm re-splits per head (float keeps that conversion exact)."""
    return (len(shape) == 2 and name.endswith(".weight") and not _is_norm(name) and not _is_router(name)
            and shape[1] % group_size == 0 and shape[0] > 1
            and not (config["model_type"] == "deepseek_v3" and name.endswith("kv_b_proj.weight")))


def bench(preset: str, out, *, layers: int | None = None, bits: int = 4, group_size: int = 64, seed: int = 0,
          dtype: str = "bfloat16", force: bool = False, progress: bool = True) -> Path:
    from deltafin.runtime.store import StoreWriter
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if bits not in (2, 3, 4, 5, 6, 8):
        raise SystemExit(f"unsupported bits {bits} (mlx affine quantization: 2, 3, 4, 5, 6 or 8)")
    config = dict(PRESETS[preset], torch_dtype=dtype, dtype=dtype, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                  pad_token_id=None)
    config["rope_parameters"] = rope_parameters(config["rope_theta"], config.get("rope_scaling"))
    if layers is not None:
        config["num_hidden_layers"] = layers
        if "max_window_layers" in config:
            config["max_window_layers"] = layers
    info = archinfo.arch_for(config)
    shapes = {archinfo.store_name(info, n): shape for n, shape in tensor_shapes(config).items()}
    pattern = archinfo.expert_pattern(info)
    act = info.activation(config)
    quant = None if act is None else {**{p: {"bits": bits, "group_size": group_size} for p in archinfo.PROJS},
                                      "activation": act}
    experts: dict[tuple[int, int], dict[str, tuple]] = {}
    dense = {}
    for name, shape in shapes.items():
        m = pattern.match(name)
        if m:
            experts.setdefault((int(m[1]), int(m[2])), {})[info.proj_names[m[3]]] = shape
        else:
            dense[name] = shape
    q = _RandomQuant(seed, bits, group_size, dtype)
    writer = StoreWriter(out, config, bits, group_size, force=force,
                         dense_quantization={"bits": bits, "group_size": group_size},
                         extra={"synthetic": {"preset": preset, "seed": seed}})
    with writer:
        for name in sorted(dense, key=_natural):
            shape = dense[name]
            if _quantize_dense(name, shape, group_size, config):
                base = name[: -len(".weight")]
                for k, arr in q.tensor(*shape, init_std(name, shape)).items():
                    writer.add_dense(f"{base}.{k}", "uint32" if k == "weight" else dtype, arr.shape, arr)
            else:
                dt = _tensor_dtype(name, dtype)
                writer.add_dense(name, dt, shape, _cast(init_tensor(name, shape, seed), dt))
        keys = sorted(experts)
        bar = progress_bar(len(keys), f"{preset}: experts", progress, unit="expert")
        for layer, e in keys:
            rec = {}
            for proj, (o, i) in experts[(layer, e)].items():
                rec.update({f"{proj}.{k}": v for k, v in q.tensor(o, i, 1.0 / math.sqrt(i)).items()})
            writer.add_expert(layer, e, rec, quant)
            bar.update(1)
        bar.close()
        with tempfile.TemporaryDirectory() as td:
            for f in write_tokenizer(Path(td), 512):
                writer.add_tokenizer_file(f)
        return writer.finish()


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------

def _key_json(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=JSON, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{key}: value is not JSON ({e}); quote strings: {key}='\"...\"'") from None


def _cmd_tiny(a) -> int:
    out = tiny(a.arch, a.out, layers=a.layers, experts=a.experts, top_k=a.top_k, hidden=a.hidden,
               moe_intermediate=a.moe_intermediate, vocab=a.vocab, dtype=a.dtype, seed=a.seed,
               shards=a.shards, q_lora_rank=a.q_lora_rank, overrides=dict(a.set), init=a.init)
    print(f"wrote {a.arch} checkpoint to {out}")
    return 0


def _cmd_bench(a) -> int:
    out = bench(a.preset, a.out, layers=a.layers, bits=a.bits, group_size=a.group_size, seed=a.seed,
                dtype=a.dtype, force=a.force)
    print(f"wrote {a.preset} store to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(formatter_class=Help, prog="deltafin-synth", description="Synthetic MoE checkpoints and stores.")
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("tiny", formatter_class=Help, help="tiny random Hugging Face checkpoint")
    t.add_argument("arch", choices=TINY_ARCHS)
    t.add_argument("out")
    t.add_argument("--layers", type=int, default=None, help="default 2 (3 for deepseek: first is dense)")
    t.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    t.add_argument("--top-k", type=int, default=2, help="experts each token uses per layer")
    t.add_argument("--hidden", type=int, default=128, help="hidden size")
    t.add_argument("--moe-intermediate", type=int, default=128, help="an expert's intermediate size")
    t.add_argument("--vocab", type=int, default=512, help="vocabulary size")
    t.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32", help="dtype of every tensor")
    t.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    t.add_argument("--shards", type=int, default=1, help="safetensors files the weights are split into")
    t.add_argument("--q-lora-rank", type=int, default=None, help="deepseek_v2: use q_a/q_b projections")
    t.add_argument("--init", choices=("unit", "hf"), default="unit",
                   help="unit: std 1/sqrt(fan_in), embeddings 1 (the tests' references); hf: as "
                        "transformers initializes a model (normal with initializer_range, biases 0)")
    t.add_argument("--set", type=_key_json, action="append", default=[], metavar="KEY=JSON",
                   help="override a config.json key, value in JSON (repeatable): --set n_group=2 "
                        "--set tie_word_embeddings=true --set 'rope_parameters={\"rope_type\": \"default\"}'")
    t.set_defaults(func=_cmd_tiny)

    b = sub.add_parser("bench", formatter_class=Help, help="full-size random store in deltafin's format")
    b.add_argument("preset", choices=tuple(PRESETS))
    b.add_argument("out")
    b.add_argument("--layers", type=int, default=None, help="override the layer count")
    b.add_argument("--bits", type=int, default=4, help="bits per quantized expert weight")
    b.add_argument("--group-size", type=int, default=64, help="weights sharing one scale and bias")
    b.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16",
                   help="dtype of scales, norms and unquantized dense weights")
    b.add_argument("--seed", type=int, default=0, help="random seed of the data")
    b.add_argument("--force", action="store_true", help="replace OUT if it exists")
    b.set_defaults(func=_cmd_bench)

    add_demo_parser(sub)  # the demo model's builder lives in tools/demo_model.py
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    sys.exit(main())
