"""What a new user meets, continued: a chat's default max_tokens, the chat REPL's prompt cache
and Hugging Face cache ids, prefill progress and a token's time split, the forecast with one flag."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import config_flags

ARCH = "mixtral"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a chat's default max_tokens ----------------------------------------------------------------
def test_http_chat_without_max_tokens_takes_the_configured_default(tiny_stores, tmp_path):
    """Real processes: with [http] default_max_tokens = 3, an HTTP chat and a ZeroMQ chat that
    give no max_tokens stop at 3 tokens (`length`), the same tokens as max_tokens 3 given; one
    that gives max_tokens keeps it."""
    from deltafin.client import Client
    from deltafin.tools.run import running_supervisor
    port = free_port()
    store = tiny_stores(ARCH)
    messages = [{"role": "user", "content": "hello there, how are you"}]
    flags = config_flags(tmp_path, http={"default_max_tokens": 3})
    with running_supervisor(store, "4GiB", ["--http", f"127.0.0.1:{port}", *flags]) as (endpoint, proc):
        with Client(endpoint) as c:
            given = c.generate(messages, max_tokens=3, chat=True)
            default = c.generate(messages, max_tokens=None, chat=True)
            longer = c.generate(messages, max_tokens=8, chat=True)
        assert given.finish_reason == "length", "the tiny model ended early: pick another prompt"
        assert default.token_ids == given.token_ids and default.finish_reason == "length"
        assert len(longer.token_ids) > 3
        for line in proc.stdout:
            if line.startswith("HTTP "):
                break
        body = json.dumps({"model": store.name, "messages": messages, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.loads(r.read())
    assert answer["usage"]["completion_tokens"] == len(given.token_ids)
    assert answer["choices"][0]["message"]["content"] == given.text
