"""The launcher's process context: whole lines, prefixes, first failure stops the rest."""

from __future__ import annotations

import io
import sys

from pskv.launch.process import ProcessContext

WRITER = """
import sys, time
for i in range(5):
    sys.stdout.write("part-a ")
    sys.stdout.flush()
    time.sleep(0.01)
    sys.stdout.write("part-b %d\\n" % i)
    sys.stdout.flush()
sys.stdout.write("progress 1\\rprogress 2\\r")
sys.stdout.write("no newline at the end")
"""


def test_lines_never_mix_and_are_prefixed() -> None:
    out, err = io.StringIO(), io.StringIO()
    ctx = ProcessContext(stdout=out, stderr=err)
    procs = [ctx.start(f"worker {i}", [sys.executable, "-u", "-c", WRITER], {}) for i in range(3)]
    assert ctx.wait(procs, []) == 0
    lines = out.getvalue().splitlines()
    for i in range(3):
        mine = [line for line in lines if line.startswith(f"[worker {i}] ")]
        assert [m for m in mine if "part" in m] == [f"[worker {i}] part-a part-b {n}" for n in range(5)]
        assert f"[worker {i}] no newline at the end" in mine
    assert all(line.startswith("[worker ") for line in out.getvalue().replace("\r", "\n").splitlines())


def test_first_failure_stops_the_others_and_is_reported() -> None:
    out, err = io.StringIO(), io.StringIO()
    ctx = ProcessContext(stdout=out, stderr=err, grace=1.0)
    sleeper = ctx.start("worker 0", [sys.executable, "-c", "import time; time.sleep(60)"], {})
    failer = ctx.start("worker 1", [sys.executable, "-c", "import sys; print('bye', file=sys.stderr); sys.exit(7)"], {})
    assert ctx.wait([sleeper, failer], []) == 7
    assert sleeper.returncode is not None
    assert "worker 1 exited with status 7" in err.getvalue() and "    bye" in err.getvalue()
