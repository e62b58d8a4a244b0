"""Peak RSS of deltafin-convert on multi-shard FP8 checkpoints (DeepSeek-V3 layout) at 1x and 4x
the experts: the converter's memory must not grow with the checkpoint.

    python -m deltafin.tools.fp8_rss OUTDIR [--mode mxfp4]

Writes two random FP8 checkpoints (float8_e4m3fn projections with 128x128 block scales, bfloat16
elsewhere; 100 MiB shards; needs torch) of 3 and 12 MoE layers x 64 experts into OUTDIR,
converts each under /usr/bin/time -v and prints the checkpoint sizes and peak RSS."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

from deltafin.runtime import quantmodes
from deltafin.runtime.cli import Help
from deltafin.tools.fp8 import BLOCK, SCALE_SUFFIX
from deltafin.tools.synth import write_tokenizer
from deltafin.tools.synth_configs import hub_config
from deltafin.tools.synth_shapes import tensor_shapes

SHARD_BYTES = 100 << 20


def _tensors(name: str, shape: tuple, gen) -> dict:
    import torch
    if len(shape) == 2 and name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
        codes = torch.randint(0, 0x7E, shape, dtype=torch.uint8, generator=gen)  # no NaN codes
        codes |= torch.randint(0, 2, shape, dtype=torch.uint8, generator=gen) << 7
        blocks = tuple(-(-d // BLOCK) for d in shape)
        return {name: codes.view(torch.float8_e4m3fn), name + SCALE_SUFFIX: torch.rand(blocks, generator=gen) * 1e-3}
    return {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)}


def write_fp8(out: Path, moe_layers: int) -> int:
    """A random FP8 checkpoint of `moe_layers` MoE layers (and one dense); returns its bytes."""
    import torch
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    cfg = hub_config("deepseek_v3", layers=moe_layers + 1, experts=64, top_k=4, hidden=1024,
                     moe_intermediate=512, vocab=4096, dtype="bfloat16", q_lora_rank=256)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [BLOCK, BLOCK]}
    gen = torch.Generator().manual_seed(0)
    shard, weight_map, total = {}, {}, 0

    def flush():
        fname = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
        shard.clear()
    for name, shape in tensor_shapes(cfg).items():
        new = _tensors(name, shape, gen)
        total += sum(t.numel() * t.element_size() for t in new.values())
        shard.update(new)
        if sum(t.numel() * t.element_size() for t in shard.values()) >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    write_tokenizer(out, cfg["vocab_size"])
    return total


def peak_rss_mib(src: Path, out: Path, mode: str) -> float:
    """Peak RSS of one deltafin-convert run, in MiB (GNU time's maximum resident set size)."""
    r = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "deltafin.tools.convert", str(src),
                        str(out), "--mode", mode, "--no-progress", "--force"], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"conversion failed:\n{r.stderr[-2000:]}")
    return int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)[1]) / 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="python -m deltafin.tools.fp8_rss", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--mode", default="mxfp4", choices=quantmodes.MODES)
    a = p.parse_args(argv)
    for name, layers in (("1x", 3), ("4x", 12)):
        src = a.out / f"fp8-{name}"
        total = write_fp8(src, layers)
        rss = peak_rss_mib(src, a.out / f"store-{name}", a.mode)
        print(f"{name}: {layers} MoE layers, {total / 2**20:.0f} MiB in "
              f"{len(list(src.glob('*.safetensors')))} shards -> peak RSS {rss:.0f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
