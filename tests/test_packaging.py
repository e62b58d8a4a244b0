"""The installed package lives under `deltafin.` only; no bare runtime/tools/protocol/workers."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_only_the_deltafin_namespace(tmp_path):
    # a build in isolation, as `pip install .` does it (setuptools comes from the package index)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "-q", "-w", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    wheel = next(tmp_path.glob("deltafin-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"deltafin"}
    for module in ("deltafin/runtime/store.py", "deltafin/workers/router.py", "deltafin/workers/loader.py",
                   "deltafin/workers/compute.py", "deltafin/protocol/messages.py", "deltafin/client/__init__.py",
                   "deltafin/tools/convert.py", "deltafin/runtime/models/mixtral.py",
                   "deltafin/configs/default.toml", "deltafin/configs/routing_stats.json",
                   "deltafin/configs/demo_moe.npz"):
        assert module in names
    # every module of the tree, subpackages included (a package missing from pyproject's list is
    # left out of the wheel, and only a non-editable install shows it)
    mapped = {"runtime": "runtime", "workers": "workers", "protocol/client": "client", "protocol": "protocol",
              "tools": "tools", "configs": "configs"}
    for folder, name in mapped.items():
        for f in (ROOT / folder).rglob("*.py"):
            rel = f.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts or (folder == "protocol" and rel.parts[0] == "client"):
                continue
            assert f"deltafin/{name}/{rel.as_posix()}" in names, f"{folder}/{rel} is not in the wheel"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry).decode()
    for script in ("deltafin-convert", "deltafin-synth", "deltafin-supervisor", "deltafin-run", "deltafin-demo"):
        assert f"{script} = deltafin." in scripts
