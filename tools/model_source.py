"""What a MODEL argument names, as a store to run: a deltafin store as it is; a Hugging Face or
mlx-lm checkpoint directory, or a model id (org/name) in the local Hugging Face cache
(`download`: fetched into it first), converted once (deltafin-convert's defaults) into a store in
the deltafin cache after a free-disk check, and reused from there. `deltafin chat` and
`deltafin-supervisor --model` both take MODEL this way."""
from __future__ import annotations

import hashlib
import re
import shutil
import sys
from pathlib import Path

from deltafin.runtime.config import format_size
from deltafin.runtime.store import StoreError, is_checkpoint
from deltafin.tools import convert
from deltafin.runtime.config import cache_dir

MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # a Hugging Face model id, org/name


class ModelSourceError(StoreError):
    """MODEL names no store and cannot be made one (no checkpoint, not in the cache, no disk)."""


def say(message: str) -> None:
    print(f"deltafin: {message}", file=sys.stderr, flush=True)


def converted_path(src: Path, name: str | None = None) -> Path:
    """Where a checkpoint's store lives: the cache, named by `name` (default: the checkpoint
    directory's) and a digest of the checkpoint's path."""
    digest = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:10]
    return cache_dir() / "stores" / f"{name or src.resolve().name}-{digest}"


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def hub_snapshot(model_id: str, download: bool = False) -> Path:
    """The local Hugging Face cache's snapshot of a model id (huggingface_hub's cache layout,
    $HF_HUB_CACHE or ~/.cache/huggingface/hub); fetched into it first only when `download`."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return Path(huggingface_hub.snapshot_download(model_id, local_files_only=not download))
    except LocalEntryNotFoundError:
        raise ModelSourceError(f"{model_id} is not in the local Hugging Face cache "
                        f"({huggingface_hub.constants.HF_HUB_CACHE}): pass --download to fetch it") from None
    except Exception as e:  # the network, an unknown or gated repository
        raise ModelSourceError(f"{model_id}: could not be fetched ({type(e).__name__}: {e})") from None


def store_for(model: str, download: bool = False) -> Path:
    """The store to run: MODEL itself, or MODEL converted once (a checkpoint directory, or a
    model id's snapshot in the Hugging Face cache)."""
    path = Path(model).expanduser()
    if (path / "manifest.json").exists():
        return path
    name = None
    if not path.exists() and MODEL_ID.match(model):
        path, name = hub_snapshot(model, download), model.replace("/", "--")
        say(f"{model}: the Hugging Face cache's snapshot {path}")
    if not is_checkpoint(path):
        raise ModelSourceError(f"{model}: neither a deltafin store, a Hugging Face / mlx-lm checkpoint "
                        f"directory (config.json and *.safetensors), nor a model id in the Hugging Face cache")
    out = converted_path(path, name)
    if (out / "manifest.json").exists():
        say(f"using the store converted before: {out}")
        return out
    need = tree_bytes(path)  # a 4-bit store is smaller than its float source: this bound is safe
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise ModelSourceError(f"converting {path} needs up to {format_size(need, up=True)} in {out.parent}; "
                        f"{format_size(free)} free")
    say(f"{path} is a checkpoint: converting it once into {out} ({format_size(free)} free)")
    if convert.main([str(path), str(out), "--force"]) != 0:
        shutil.rmtree(out, ignore_errors=True)
        raise ModelSourceError(f"converting {path} failed (above)")
    say(f"converted: {format_size(tree_bytes(out))} store in {out}")
    return out


