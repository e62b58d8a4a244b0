"""Shared fixtures: tiny stores per architecture, and the no-leftovers check after every test."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

from deltafin.runtime import archinfo, shm

ARCHS = list(archinfo.ARCHS)


@pytest.fixture(autouse=True, scope="session")
def private_run_root(tmp_path_factory):
    """Runs of the test session live in their own root, so the sweep never touches a user's runs."""
    root = tmp_path_factory.mktemp("runs")
    os.environ["DELTAFIN_RUN_ROOT"] = str(root)
    yield root


def _root() -> str:
    return os.environ.get("DELTAFIN_RUN_ROOT", "")


def deltafin_segments() -> list[str]:
    """Segments recorded by runs of this test session that still exist."""
    import json
    names = []
    for meta in shm.runs_root().glob("*/run.json"):
        try:
            names += json.loads(meta.read_text()).get("segments", [])
        except (OSError, ValueError):
            pass
    return [n for n in names if Path("/dev/shm", n).exists()] if Path("/dev/shm").exists() else names


def deltafin_processes() -> list[psutil.Process]:
    """Processes started by this test session (they inherit its DELTAFIN_RUN_ROOT); other
    deltafin runs on the machine are not ours to judge or kill."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline", "name"]):
        cmd = " ".join(p.info["cmdline"] or [])
        ours = "deltafin.workers." in cmd or (p.info["name"] or "").startswith("dfn-")  # forked: named
        if p.info["pid"] == os.getpid() or not ours:
            continue
        try:
            if p.environ().get("DELTAFIN_RUN_ROOT") == _root():
                found.append(p)
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            pass
    return found


def worker_process(supervisor_pid: int, role: str) -> psutil.Process:
    """The supervisor's worker of `role`: forked from its fork server (named dfn-ROLE, the
    supervisor's command line) or a fresh `python -m deltafin.workers.ROLE`."""
    return next(k for k in psutil.Process(supervisor_pid).children()
                if k.name() == f"dfn-{role}" or f"deltafin.workers.{role}" in " ".join(k.cmdline()))


@pytest.fixture(autouse=True)
def nothing_left_behind(request):
    """After every test: no deltafin process and no shared-memory segment remain."""
    yield
    deadline = time.monotonic() + 10
    while (deltafin_processes() or deltafin_segments()) and time.monotonic() < deadline:
        time.sleep(0.1)
    procs = deltafin_processes()
    segs = set(deltafin_segments())
    for p in procs:
        p.kill()
    assert not procs, f"processes left after {request.node.name}: {[p.info['cmdline'] for p in procs]}"
    assert not segs, f"shared-memory segments left after {request.node.name}: {segs}"


@pytest.fixture(scope="session")
def tiny_stores(tmp_path_factory):
    """{arch: store path} of tiny float checkpoints converted by deltafin-convert (built lazily)."""
    from deltafin.tools import convert
    from deltafin.tools.synth import tiny
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            src = tiny(arch, root / f"{arch}-hf", seed=11)
            out = root / f"{arch}-store"
            assert convert.main([str(src), str(out), "--no-progress"]) == 0
            cache[arch] = out
        return cache[arch]
    return get


@pytest.fixture(scope="session")
def mlx_lm_stores(tmp_path_factory):
    """{arch: (mlx-lm quantized checkpoint, store converted from it)}, built lazily."""
    pytest.importorskip("mlx_lm")
    from mlx_lm import convert as mlx_convert

    from deltafin.tools import convert
    from deltafin.tools.synth import for_mlx_lm, tiny
    root = tmp_path_factory.mktemp("mlxlm")
    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            src = tiny(arch, root / f"{arch}-hf", seed=12, dtype="bfloat16")
            q = root / f"{arch}-q4"
            mlx_convert(str(for_mlx_lm(src)), str(q), quantize=True, q_bits=4, q_group_size=64)
            out = root / f"{arch}-store"
            assert convert.main([str(q), str(out), "--no-progress"]) == 0
            cache[arch] = (q, out)
        return cache[arch]
    return get


def greedy_alone(c, prompt: list, steps: int) -> list:
    """In-process greedy decoding by a Compute `c`, one row a pass: prompt[:-1] prefilled, then
    `steps` passes from prompt[-1]; the logits of each pass (numpy)."""
    import mlx.core as mx
    import numpy as np
    m = c.model
    cache, tok, out = m.make_cache(), prompt[-1], []
    if len(prompt) > 1:
        c.forward(prompt[:-1], cache)
    for _ in range(steps):
        pno = c.experts.begin_pass(1)
        lg = m(mx.array([tok], dtype=mx.int32), cache, c.experts)
        mx.eval(lg)
        c.experts.commit(pno, rows=False)
        out.append(np.array(lg[-1]))
        tok = int(np.argmax(out[-1]))
    return out


def batched_equals_alone(c, prompts: list, steps: int, alone: list | None = None) -> list:
    """Decodes `prompts` together by a Compute `c` (prompt[:-1] prefilled per sequence, then
    `steps` passes of forward_batch over all rows) and asserts each row's logits equal, bitwise,
    what its sequence gives alone (`greedy_alone`, or `alone` where given). Returns the caches."""
    import mlx.core as mx
    import numpy as np
    m = c.model
    alone = alone or [greedy_alone(c, p, steps) for p in prompts]
    caches = [m.make_cache() for _ in prompts]
    for p, cache in zip(prompts, caches):
        if len(p) > 1:
            c.forward(p[:-1], cache)
    toks = [p[-1] for p in prompts]
    for s in range(steps):
        pno = c.experts.begin_pass(len(prompts))
        lg = m.forward_batch(mx.array(toks, dtype=mx.int32), caches, c.experts)
        mx.eval(lg)
        c.experts.commit(pno, rows=False)
        got = np.array(lg)
        for b in range(len(prompts)):
            assert np.array_equal(got[b], alone[b][s]), (s, b, np.abs(got[b] - alone[b][s]).max())
        toks = [int(t) for t in np.argmax(got, axis=-1)]
    return caches


def mlx_lm_greedy(ckpt, prompt, n) -> list[int]:
    """mlx-lm's greedy tokens, ending before an end-of-sequence token as its generate does (and
    the runtime: a random tiny model may well pick one)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model
    model, _ = load_model(ckpt)
    eos = json.loads((Path(ckpt) / "config.json").read_text()).get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    out = []
    for t, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        if int(t) in eos:
            break
        out.append(int(t))
    return out


def config_flags(tmp_path, **sections) -> list[str]:
    """`--config FILE` flags for a supervisor: a TOML file in tmp_path with the given sections."""
    text = "".join(f"[{s}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in kv.items())
                   for s, kv in sections.items())
    path = tmp_path / "deltafin.toml"
    path.write_text(text)
    return ["--config", str(path)]
