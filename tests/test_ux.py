"""What a new user meets: the budget explaining itself, sizes, a checkpoint given where a store is
wanted, help texts."""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from importlib import import_module
from pathlib import Path

import pytest

from deltafin.runtime import budget
from deltafin.runtime.config import ConfigError, load_config, parse_size
from deltafin.runtime.store import Store, StoreError

ARCH = "mixtral"
ROOT = Path(__file__).resolve().parents[1]


# -- sizes ----------------------------------------------------------------------------------------
def test_sizes_mean_what_the_docs_say():
    """A bare letter is binary like the IEC names (400M = 400MiB); the SI names are decimal."""
    assert parse_size("400M") == parse_size("400MiB") == parse_size("400m") == 400 << 20
    assert parse_size("6G") == 6 << 30 and parse_size("6GB") == 6 * 10**9
    assert parse_size("400mb") == 400 * 10**6
    with pytest.raises(ConfigError, match="2\\^20"):
        parse_size("400 megs")
    with pytest.raises(ConfigError, match="more than 0"):
        load_config(None, {"runtime.memory_budget": "0M"})


# -- the plan -------------------------------------------------------------------------------------
def few_slot_budget(store: Store) -> str:
    """A budget whose expert slots at max_context 2048 are fewer than FEW_SLOTS of the experts
    (estimated as the supervisor does) while at 512 they are not."""
    cfg = load_config(None, {"compute.max_context": 512})
    plan = budget.plan_budget(store, cfg)
    total = sum(plan.group_experts.values())
    return str(plan.budget_for(int(budget.FEW_SLOTS * total) + 2))


def test_fit_context_lowers_max_context_for_slots_and_says_how_to_keep_it(tiny_stores):
    store = Store(tiny_stores(ARCH))
    size = few_slot_budget(store)
    total = sum(budget.plan_budget(store, load_config()).group_experts.values())
    cfg = load_config(None, {"runtime.memory_budget": size})
    before = budget.plan_budget(store, cfg).estimated_slots()
    assert before < budget.FEW_SLOTS * total  # the default context starves the experts
    note = budget.fit_context(store, cfg)
    assert cfg.compute.max_context < 2048 and "--max-context 2048" in note
    after = budget.plan_budget(store, cfg).estimated_slots()
    assert after >= budget.FEW_SLOTS * total > before
    # an explicit context is kept
    kept = load_config(None, {"runtime.memory_budget": size, "compute.max_context": 2048,
                              "compute.fit_context": False})
    assert budget.fit_context(store, kept) == "" and kept.compute.max_context == 2048


def test_the_plan_names_each_part_and_what_gives_more_slots(tiny_stores):
    store = Store(tiny_stores(ARCH))
    cfg = load_config(None, {"runtime.memory_budget": few_slot_budget(store), "compute.fit_context": False})
    plan = budget.plan_budget(store, cfg)
    lines = plan.explain(2048, 8, 128)
    assert lines == budget.plan_budget(store, cfg).explain(2048, 8, 128)  # deterministic
    text = "\n".join(lines)
    for part in ("dense weights", "KV cache", "max_context 2048", "activations", "staging",
                 "expert slots", "few slots", "--max-context 512", "--memory-budget"):
        assert part in text, part
    total = sum(plan.group_experts.values())
    assert re.search(rf"expert slots +\d+ of {total} experts \(\d+%\)", text)
    # the suggested budget gives what it says
    suggested = re.search(r"--memory-budget (\S+) \(about (\d+)\)", text)
    cfg.runtime.memory_budget = suggested[1]
    assert budget.plan_budget(store, cfg).estimated_slots() >= int(suggested[2])


def test_supervisor_prints_its_plan_and_lowers_an_unasked_context(tiny_stores):
    """Real processes: the default command at a budget that max_context 2048 would starve."""
    path = tiny_stores(ARCH)
    size = few_slot_budget(Store(path))
    proc = subprocess.Popen([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(path),
                             "--memory-budget", size], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY"), proc.stderr.read()[-2000:]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert "memory plan for a" in err and "max_context lowered from 2048 to" in err
    assert re.search(r"expert slots +\d+ of \d+ experts", err)


# -- a checkpoint where a store is wanted --------------------------------------------------------
def test_a_checkpoint_given_as_a_store_is_told_how_to_convert(tmp_path):
    from deltafin.tools.synth import tiny
    src = tiny(ARCH, tmp_path / "ckpt", seed=3)
    with pytest.raises(StoreError, match=r"this is a checkpoint.*deltafin-convert .* OUT.*deltafin chat"):
        Store(src)
    r = subprocess.run([sys.executable, "-m", "deltafin.workers.supervisor", "--model", str(src)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "deltafin-convert" in r.stderr


# -- help -----------------------------------------------------------------------------------------
class Parsed(Exception):
    pass


def command_parsers(monkeypatch) -> dict:
    """{console script: its argument parser}, each caught as its main() parses."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    found = {}

    def catch(self, *a, **k):
        found[name] = self
        raise Parsed
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    for name, target in scripts.items():
        module, func = target.split(":")
        with pytest.raises(Parsed):
            getattr(import_module(module), func)(["--help"])
    return found


def all_parsers(p: argparse.ArgumentParser):
    yield p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from all_parsers(sub)


def test_every_flag_of_every_command_has_help_showing_its_default(monkeypatch):
    missing = []
    for name, top in command_parsers(monkeypatch).items():
        for p in all_parsers(top):
            formatter = p._get_formatter()
            for action in p._actions:
                if not action.option_strings or isinstance(action, argparse._HelpAction):
                    continue
                text = formatter._get_help_string(action) if action.help else ""
                if not action.help or "default" not in text:
                    missing.append(f"{p.prog} {action.option_strings[0]}")
                if re.search(r"issue \d+", text, re.I):
                    missing.append(f"{p.prog} {action.option_strings[0]}: internal words")
            if re.search(r"issue \d+", p.format_help(), re.I):
                missing.append(f"{p.prog}: internal words")
    assert not missing, "\n".join(missing)
