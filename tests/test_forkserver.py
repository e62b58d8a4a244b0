"""The fork server alone (runtime/forkserver.py), in a process of its own (it makes its caller a
child subreaper): a forked worker runs its entry, is adopted by the caller, shows its name and
hands its exit code to `Forked.wait`; a signal reaches it; it shares the preloaded pages
(procmem.cow_shared); a closed server refuses to spawn."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

ENTRY = """
import os, sys
class Entry:
    def __init__(self, arg):
        self.arg = arg
    def serve(self):
        name = open("/proc/self/comm").read().strip()
        with open(self.arg, "w") as f:
            f.write(f"{os.getppid()} {name} {'numpy' in sys.modules}")
        if self.arg.endswith("wait"):
            import time
            time.sleep(60)
        sys.exit(3)
"""

CALLER = """
import os, signal, sys
sys.path.insert(0, sys.argv[1])
from deltafin.runtime.forkserver import ForkServer, ForkServerError
fs = ForkServer.start(("numpy",))
assert fs is not None
p = fs.spawn("entrymod:Entry", sys.argv[1] + "/out", "dfn-test")
assert p.wait(timeout=30) == 3, p.returncode
ppid, name, preloaded = open(sys.argv[1] + "/out").read().split()
assert int(ppid) == os.getpid() and name == "dfn-test" and preloaded == "True", (ppid, name, preloaded)
q = fs.spawn("entrymod:Entry", sys.argv[1] + "/out-wait", "dfn-test")
assert q.poll() is None
import time
from deltafin.runtime.procmem import cow_shared
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1] + "/out-wait") and time.monotonic() < deadline:
    time.sleep(0.01)
shared = cow_shared([os.getpid(), q.pid])  # numpy's pages, imported before the fork
assert shared > 4 << 20 and cow_shared([os.getpid()]) < shared, shared
q.send_signal(signal.SIGKILL)
assert q.wait(timeout=30) == -signal.SIGKILL
fs.close()
try:
    fs.spawn("entrymod:Entry", sys.argv[1] + "/out", "dfn-test")
except ForkServerError:
    print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux's")
def test_forked_entry_is_adopted_named_and_reaped(tmp_path):
    (tmp_path / "entrymod.py").write_text(textwrap.dedent(ENTRY))
    r = subprocess.run([sys.executable, "-c", CALLER, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
