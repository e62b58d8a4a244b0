"""deltafin chat MODEL: a conversation in the terminal with a model streamed from its store.

MODEL is a deltafin store, a Hugging Face / mlx-lm checkpoint directory, or a model id (org/name)
already in the local Hugging Face cache (--download fetches it there first); a checkpoint is
converted once (deltafin-convert's defaults, progress shown) into a store in the deltafin cache,
after a free-disk check, and reused from there. The runtime starts under the memory budget with
a prompt cache for the conversation and prints its plan; then each line typed is a user turn,
answered in a stream with the whole conversation as context: the previous turns' keys and values
come from the prompt cache, so a turn prefills little more than its own message. While a prompt
is prefilled its progress shows; after each answer: tokens, decode tok/s, the expert hit rate, the
prefill (how much came from the prompt cache) and a decode token's time split.
Commands: /stats (the runtime's figures), /budget (its memory), /quit (or end of input).
"""
from __future__ import annotations

import argparse
import sys

from deltafin.client import Client, DeltafinError
from deltafin.runtime import archinfo
from deltafin.runtime.budget import kv_bytes_per_token
from deltafin.runtime.cli import Help
from deltafin.runtime.config import ConfigError, format_size, load_config, parse_size
from deltafin.runtime.dtypes import itemsize as dtype_itemsize
from deltafin.runtime.layerkinds import prefix_unsupported
from deltafin.runtime.store import Store, StoreError
from deltafin.tools import convert
from deltafin.tools.model_source import ModelSourceError, say, store_for
from deltafin.tools.run import StartError, format_latencies, running_supervisor, stream_with_progress

COMMANDS = "/stats, /budget, /quit"
PROMPT_CACHE_SHARE = 0.1  # the chat's prompt cache takes at most this share of the budget


def answer_line(stats: dict) -> str:
    """tokens, decode tok/s and hit rate of one answer; its prefill (tokens, those the prompt
    cache gave, rate) and a decode token's time split."""
    decode = stats.get("decode") or {}
    uses, hits = decode.get("uses") or 0, decode.get("hits") or 0
    rate = f"{stats['decode_tok_s']:.2f} tok/s" if stats.get("decode_tok_s") else "- tok/s"
    hit = f"hit rate {hits / uses:.0%}" if uses else "hit rate -"
    prefill = f"prefill {stats.get('prompt_tokens', 0)} tokens ({stats.get('cached_tokens', 0)} from the prompt cache"
    prefill += f", {stats['prefill_tok_s']:.1f} tok/s)" if stats.get("prefill_tok_s") else ")"
    return f"[{stats.get('generated_tokens', 0)} tokens, {rate}, {hit}, {prefill}{token_split(decode)}]"


def token_split(decode: dict) -> str:
    """'; per token: compute .. ms, waiting .., prepare .., messages ..' of a decode phase's
    stats ('' without decode tokens)."""
    n = decode.get("tokens") or 0
    if not n:
        return ""
    parts = (("compute", "compute_s"), ("waiting", "wait_s"), ("prepare", "prepare_s"), ("messages", "ipc_s"))
    return "; per token: " + ", ".join(f"{name} {decode.get(k, 0) * 1e3 / n:.1f} ms" for name, k in parts)


def prompt_cache_size(store: Store, a: argparse.Namespace) -> int:
    """The chat's prompt cache: --prompt-cache, else the keys and values of a whole context (the
    conversation so far is each turn's prefix), at most PROMPT_CACHE_SHARE of the budget; 0 for a
    family whose caches cannot start from a prefix."""
    if a.prompt_cache is not None:
        return parse_size(a.prompt_cache)
    if prefix_unsupported(archinfo.layer_caches(store.config)):
        return 0
    cfg = load_config(None, {"runtime.memory_budget": a.memory_budget, "compute.max_context": a.max_context})
    per_token = kv_bytes_per_token(store.config, dtype_itemsize(cfg.compute.dtype) or 4)
    return min(per_token * cfg.compute.max_context, int(cfg.runtime.budget_bytes * PROMPT_CACHE_SHARE))


def budget_lines(stats: dict) -> str:
    mem = stats.get("memory") or {}
    return (f"budget {format_size(mem.get('budget', 0))}: tree now {format_size(mem.get('tree_bytes', 0))}, "
            f"peak {format_size(mem.get('peak_tree_bytes', 0))}; {mem.get('n_slots')} resident expert slots, "
            f"{mem.get('staging_slots')} staging slots of {format_size(mem.get('slot_bytes', 0))}")


def repl(client: Client, a: argparse.Namespace, endpoint: str, read=input) -> None:
    """The conversation: user lines in, streamed answers out (the prefill's progress before
    them), until /quit or end of input."""
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
            for piece in stream_with_progress(client, endpoint, history, max_tokens=a.max_tokens,
                                              temperature=a.temperature, seed=a.seed):
                sys.stdout.write(piece)
                sys.stdout.flush()
            gen = client.last
            history.append({"role": "assistant", "content": gen.text})
            print(f"\n{answer_line(gen.stats)}", flush=True)


def add_chat(sub) -> None:
    c = sub.add_parser("chat", formatter_class=Help, help="chat with a model in the terminal",
                       description=__doc__.split("\n\n")[1])
    c.add_argument("model", help="a deltafin store, a Hugging Face / mlx-lm checkpoint directory, or a "
                                 "model id (org/name) in the local Hugging Face cache")
    c.add_argument("--download", action="store_true", help="fetch a model id missing from the Hugging Face "
                                                           "cache into it (huggingface_hub; needs the network)")
    c.add_argument("--prompt-cache", metavar="SIZE", help="memory for the conversation's prompt prefixes "
                   "(default: the keys and values of a whole context, at most 10%% of the budget; 0: off)")
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
        store = Store(store_for(a.model, a.download))  # a damaged store is named before anything starts
        extra = ["--max-context", str(a.max_context)] if a.max_context else []
        cache = prompt_cache_size(store, a)
        if cache:
            say(f"prompt cache {format_size(cache)}: each turn reuses the previous turns' keys and values")
            extra += ["--prompt-cache", str(cache)]
        with running_supervisor(store.path, a.memory_budget, extra) as (endpoint, _proc):
            with Client(endpoint, timeout=600) as client:
                repl(client, a, endpoint)
        return 0
    except (ModelSourceError, StoreError, StartError, DeltafinError, ConfigError, convert.ConvertError) as e:
        say(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
