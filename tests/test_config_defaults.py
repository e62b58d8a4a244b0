"""The typed configuration's defaults (runtime/config.py) are configs/default.toml's, key by key."""
from __future__ import annotations

import tomllib
from dataclasses import asdict
from importlib import resources

from deltafin.runtime.config import Config


def test_dataclass_defaults_equal_default_toml():
    toml = tomllib.loads(resources.files("deltafin.configs").joinpath("default.toml").read_text())
    typed = asdict(Config())
    assert set(toml) == set(typed)
    for section, values in typed.items():
        assert set(toml[section]) == set(values), section
        for key, value in values.items():
            assert toml[section][key] == value, f"{section}.{key}: toml {toml[section][key]!r}, dataclass {value!r}"
