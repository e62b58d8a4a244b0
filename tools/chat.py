"""deltafin chat MODEL: a conversation in the terminal with a model streamed from its store.

MODEL is a deltafin store or a Hugging Face / mlx-lm checkpoint directory; a checkpoint is
converted once (deltafin-convert's defaults, progress shown) into a store in the deltafin cache,
after a free-disk check, and reused from there. The runtime starts under the memory budget and
prints its plan; then each line typed is a user turn, answered in a stream with the whole
conversation as context. After each answer: tokens, decode tok/s and the expert hit rate.
Commands: /stats (the runtime's figures), /budget (its memory), /quit (or end of input).
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
from pathlib import Path

from deltafin.client import Client, DeltafinError
from deltafin.runtime.cli import Help
from deltafin.runtime.config import format_size
from deltafin.runtime.store import Store, StoreError, is_checkpoint
from deltafin.tools import convert
from deltafin.tools.demo_model import cache_dir
from deltafin.tools.run import StartError, format_latencies, running_supervisor

COMMANDS = "/stats, /budget, /quit"


class ChatError(RuntimeError):
    pass


def say(message: str) -> None:
    print(f"deltafin: {message}", file=sys.stderr, flush=True)


def converted_path(src: Path) -> Path:
    """Where a checkpoint's store lives: the cache, named by the checkpoint's name and path."""
    digest = hashlib.sha256(str(src.resolve()).encode()).hexdigest()[:10]
    return cache_dir() / "stores" / f"{src.resolve().name}-{digest}"


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def store_for(model: str) -> Path:
    """The store to run: MODEL itself, or MODEL converted once (a checkpoint directory)."""
    path = Path(model).expanduser()
    if (path / "manifest.json").exists():
        return path
    if not is_checkpoint(path):
        raise ChatError(f"{model}: neither a deltafin store nor a Hugging Face / mlx-lm checkpoint "
                        f"directory (config.json and *.safetensors)")
    out = converted_path(path)
    if (out / "manifest.json").exists():
        say(f"using the store converted before: {out}")
        return out
    need = tree_bytes(path)  # a 4-bit store is smaller than its float source: this bound is safe
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise ChatError(f"converting {path} needs up to {format_size(need, up=True)} in {out.parent}; "
                        f"{format_size(free)} free")
    say(f"{path} is a checkpoint: converting it once into {out} ({format_size(free)} free)")
    if convert.main([str(path), str(out), "--force"]) != 0:
        shutil.rmtree(out, ignore_errors=True)
        raise ChatError(f"converting {path} failed (above)")
    say(f"converted: {format_size(tree_bytes(out))} store in {out}")
    return out


def answer_line(stats: dict) -> str:
    """tokens, decode tok/s and hit rate of one answer."""
    decode = stats.get("decode") or {}
    uses, hits = decode.get("uses") or 0, decode.get("hits") or 0
    rate = f"{stats['decode_tok_s']:.2f} tok/s" if stats.get("decode_tok_s") else "- tok/s"
    hit = f"hit rate {hits / uses:.0%}" if uses else "hit rate -"
    return f"[{stats.get('generated_tokens', 0)} tokens, {rate}, {hit}, prefill {stats.get('prompt_tokens', 0)} tokens]"


def budget_lines(stats: dict) -> str:
    mem = stats.get("memory") or {}
    return (f"budget {format_size(mem.get('budget', 0))}: tree now {format_size(mem.get('tree_bytes', 0))}, "
            f"peak {format_size(mem.get('peak_tree_bytes', 0))}; {mem.get('n_slots')} resident expert slots, "
            f"{mem.get('staging_slots')} staging slots of {format_size(mem.get('slot_bytes', 0))}")


def repl(client: Client, a: argparse.Namespace, read=input) -> None:
    """The conversation: user lines in, streamed answers out, until /quit or end of input."""
    history: list[dict] = [{"role": "system", "content": a.system}] if a.system else []
    print(f"chatting with {client.info.model} ({COMMANDS})", file=sys.stderr, flush=True)
    while True:
        try:
            line = read(">>> ").strip()
        except EOFError:
            return
        if line in ("/quit", "/exit"):
            return
        if line == "/stats":
            print(format_latencies(client.stats()), flush=True)
        elif line == "/budget":
            print(budget_lines(client.stats()), flush=True)
        elif line.startswith("/"):
            print(f"unknown command {line} ({COMMANDS})", flush=True)
        elif line:
            history.append({"role": "user", "content": line})
            for piece in client.stream(history, max_tokens=a.max_tokens, temperature=a.temperature,
                                       seed=a.seed):
                sys.stdout.write(piece)
                sys.stdout.flush()
            gen = client.last
            history.append({"role": "assistant", "content": gen.text})
            print(f"\n{answer_line(gen.stats)}", flush=True)


def add_chat(sub) -> None:
    c = sub.add_parser("chat", formatter_class=Help, help="chat with a model in the terminal",
                       description=__doc__.split("\n\n")[1])
    c.add_argument("model", help="a deltafin store, or a Hugging Face / mlx-lm checkpoint directory")
    c.add_argument("--memory-budget", help="bound for the whole process tree, e.g. 6GiB (default: config, "
                                           "auto = half the memory)")
    c.add_argument("--max-tokens", type=int, default=512, help="tokens per answer at most")
    c.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    c.add_argument("--seed", type=int, help="sampling seed (default: none, a fresh one)")
    c.add_argument("--system", default="", help="a system message opening the conversation")
    c.add_argument("--max-context", type=int, help="longest conversation + answer in tokens "
                                                   "(default: the supervisor's)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(formatter_class=Help, prog="deltafin", description="deltafin's commands.")
    add_chat(p.add_subparsers(dest="command", required=True))
    a = p.parse_args(argv)
    try:
        store = store_for(a.model)
        Store(store)  # a damaged store is named before anything starts
        extra = ["--max-context", str(a.max_context)] if a.max_context else []
        with running_supervisor(store, a.memory_budget, extra) as (endpoint, _proc):
            with Client(endpoint, timeout=600) as client:
                repl(client, a)
        return 0
    except (ChatError, StoreError, StartError, DeltafinError, convert.ConvertError) as e:
        say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
