"""Calibrates the compute stand-in on a GPU: mlx-lm's decode time per token of DeepSeek-V2-Lite-shaped
models (random weights, 4-bit group 64, bfloat16) with 1-7 dense and 1-13 MoE layers; a least-squares
fit gives ms per MoE layer, per dense layer and per token. Writes $OUT/calib.json (or ./calib.json).
The defaults of [bench] in configs/default.toml come from its run on the lent H200:
configs/standin-h200.json. Run: python -m deltafin.tools.standin_calib (needs mlx-lm)."""
import json
import os
import time

import numpy as np


def main():
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.generate import generate_step
    from mlx_lm.models import deepseek_v2 as ds
    print(mx.default_device(), mx.__version__, flush=True)
    base = dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                moe_intermediate_size=1408, num_attention_heads=16, num_key_value_heads=16, n_shared_experts=2,
                n_routed_experts=64, num_experts_per_tok=6, routed_scaling_factor=1.0, kv_lora_rank=512,
                q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, topk_method="greedy",
                n_group=1, topk_group=1, moe_layer_freq=1, max_position_embeddings=163840, rms_norm_eps=1e-6,
                rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})
    out = []
    for dense, moe in [(1, 1), (1, 3), (1, 7), (1, 13), (3, 3), (7, 3)]:
        mx.random.seed(0)
        args = ds.ModelArgs(**base, num_hidden_layers=dense + moe, first_k_dense_replace=dense)
        model = ds.Model(args)
        model.set_dtype(mx.bfloat16)
        nn.quantize(model, group_size=64, bits=4)
        mx.eval(model.parameters())
        prompt = mx.array(list(range(1, 33)), dtype=mx.uint32)
        res = []
        for rep in range(3):
            n = 0; t0 = None
            for tok, _ in generate_step(prompt, model, max_tokens=129):
                n += 1
                if n == 1:
                    t0 = time.perf_counter()
            res.append((time.perf_counter() - t0) / (n - 1))
        ms = min(res) * 1e3
        out.append({"dense": dense, "moe": moe, "ms_per_token": ms, "all": [r * 1e3 for r in res]})
        print(out[-1], flush=True)
        del model; mx.clear_cache()
    A = np.array([[1, o["dense"], o["moe"]] for o in out]); y = np.array([o["ms_per_token"] for o in out])
    fit = np.linalg.lstsq(A, y, rcond=None)[0]
    res = {"runs": out, "fixed_ms": fit[0], "dense_ms": fit[1], "moe_ms": fit[2], "device": str(mx.default_device()),
           "note": "mlx-lm generate_step, bf16 activations, 4-bit g64, 128 decode tokens after a 32-token prompt, best of 3"}
    print(json.dumps(res, indent=1))
    os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "calib.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
