"""Realistic-width, few-layer checkpoints of the new families: transformers-layout bf16 checkpoint
(deltafin-synth tiny with overrides) -> mlx_lm convert (the family's usual quantization) -> deltafin
store; then deltafin-resident-compare (every expert resident) against mlx-lm on the same checkpoint.
With STREAM=0.25,1.0 (shares of the experts resident) it then runs the real supervisor at each share
and checks its greedy tokens (PROMPT_N of them) against mlx-lm's on the same checkpoint.
usage: wide.py OUTDIR SCALE FAMILY[,FAMILY...]   (SCALE 1 = realistic widths; 8 = widths / 8 for a CPU dry run)"""
import json, os, subprocess, sys, time
from pathlib import Path

from mlx_lm import convert as mlx_convert
from deltafin.tools import convert
from deltafin.tools.synth import for_mlx_lm, tiny

out, scale, fams = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")


def stream(arch, ckpt, store, shares, n=int(os.environ.get("STREAM_N", "64"))):
    """Real processes at each share of the experts resident: greedy tokens against mlx-lm's."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model
    from deltafin.client import Client
    from deltafin.runtime.store import Store
    from deltafin.tools.run import running_supervisor
    prompt = [(7 * i + 3) % 200 + 1 for i in range(9)]
    model, _ = load_model(ckpt)
    ref = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]
    del model
    keys = len(Store(store).records)
    for share in shares:
        t = time.time()
        with running_supervisor(store, "64GiB", ["--max-slots", str(max(1, int(keys * share))), "--dtype", "auto"]) as (ep, _):
            with Client(ep, timeout=300) as c:
                done = c.generate(prompt, max_tokens=n)
        got = done.token_ids
        first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        print(f"== {arch} streamed at {share:.0%} of the experts on {mx.default_device()}: "
              f"{'same tokens as mlx-lm' if got and got == ref[:len(got)] else f'tokens differ from token {first}'}"
              f" ({len(got)} of {n} tokens{'' if len(got) == n else ', stopped at an end token'}, {done.stats.get('decode_tok_s', 0):.1f} tok/s, {time.time() - t:.0f} s)", flush=True)
S = lambda x: max(64, x // scale // 64 * 64) if scale > 1 else x
H = lambda x: max(2, x // scale) if scale > 1 else x
SPECS = {  # arch: (tiny kwargs, config overrides, mlx-lm q mode, group)
    "qwen3_5_moe": (dict(layers=4, experts=32, top_k=8, hidden=S(2048), moe_intermediate=S(512)),
                    dict(num_attention_heads=H(16), num_key_value_heads=2, head_dim=S(256), shared_expert_intermediate_size=S(512),
                         linear_num_key_heads=H(16), linear_num_value_heads=H(32), linear_key_head_dim=128,
                         linear_value_head_dim=128, full_attention_interval=4), "affine", 64),
    "qwen3_next": (dict(layers=4, experts=32, top_k=10, hidden=S(2048), moe_intermediate=S(512)),
                   dict(num_attention_heads=H(16), num_key_value_heads=2, head_dim=S(256), shared_expert_intermediate_size=S(512),
                        linear_num_key_heads=H(16), linear_num_value_heads=H(32), linear_key_head_dim=128,
                        linear_value_head_dim=128, full_attention_interval=4), "affine", 64),
    "kimi_k3": (dict(layers=4, experts=16, top_k=8, hidden=S(7168), moe_intermediate=S(1792)),
                dict(routed_expert_hidden_size=S(3584), num_attention_heads=H(96), num_key_value_heads=H(96),
                     linear_attn_config={"num_heads": H(96), "head_dim": 128, "short_conv_kernel_size": 4,
                                         "kda_layers": [1, 2, 3], "full_attn_layers": [4], "gate_lower_bound": -5.0},
                     q_lora_rank=S(1536), kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                     intermediate_size=S(18432)), "affine", 64),
    "kimi_linear": (dict(layers=4, experts=32, top_k=8, hidden=S(2304), moe_intermediate=S(1024)),
                    dict(num_attention_heads=H(32), num_key_value_heads=H(32), intermediate_size=S(9216), kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                         linear_attn_config={"num_heads": H(32), "head_dim": 128, "short_conv_kernel_size": 4,
                                             "kda_layers": [1, 2, 3], "full_attn_layers": [4]}), "affine", 64),
    "gpt_oss": (dict(layers=4, experts=16, top_k=4, hidden=S(2880 // 64 * 64), moe_intermediate=S(2880 // 64 * 64)),
                dict(num_attention_heads=H(64), num_key_value_heads=H(8), head_dim=64, sliding_window=128), "mxfp4", 32),
    "glm4_moe": (dict(layers=4, experts=32, top_k=8, hidden=S(4096), moe_intermediate=S(1408 // 64 * 64)),
                 dict(num_attention_heads=H(96), num_key_value_heads=H(8), head_dim=128, intermediate_size=S(10944 // 64 * 64)),
                 "affine", 64),
    "minimax_m2": (dict(layers=3, experts=32, top_k=8, hidden=S(3072), moe_intermediate=S(1536)),
                   dict(num_attention_heads=max(4, H(48)), num_key_value_heads=max(2, H(8)), head_dim=128), "affine", 64),
}
for arch in fams:
    kw, ov, mode, group = SPECS[arch]
    t0 = time.time()
    src = tiny(arch, out / f"{arch}-hf", vocab=32000, dtype="bfloat16", seed=3, overrides=ov, **kw)
    q = out / f"{arch}-q"
    mlx_convert(str(for_mlx_lm(src)), str(q), quantize=True, q_bits=4, q_group_size=group, q_mode=mode)
    st = out / f"{arch}-store"
    assert convert.main([str(q), str(st), "--no-progress"]) == 0
    t1 = time.time()
    print(f"== {arch}: built in {t1 - t0:.0f} s", flush=True)
    r = subprocess.run([sys.executable, "-m", "deltafin.tools.resident_compare", "--store", str(st), "--mlx-model", str(q),
                        "--tokens", os.environ.get("TOK", "64"), "--rounds", os.environ.get("ROUNDS", "5"),
                        "--json", str(out / f"rc_{arch}.json")], capture_output=True, text=True, timeout=600)
    print(r.stdout[-1500:], r.stderr[-1500:], flush=True)
    print(f"== {arch}: compared in {time.time() - t1:.0f} s", flush=True)
    if os.environ.get("STREAM"):
        stream(arch, q, st, [float(x) for x in os.environ["STREAM"].split(",")])
