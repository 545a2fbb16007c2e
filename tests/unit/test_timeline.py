"""pskv.ps.timeline: spans leave memory as they are recorded, and a merge skips a line cut short."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from pskv.ps import timeline

REPO = Path(__file__).resolve().parents[2]


def test_spans_reach_the_file_during_a_long_run_and_merge_skips_a_cut_line(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    code = """if True:
        import os
        from pskv.ps import timeline
        timeline.start("worker", 0)
        for i in range(5000):
            timeline.span("send PUSH", timeline.now(), server=i % 2)
        assert len(timeline._lines) < 1000, "spans kept in memory"
        os._exit(0)  # killed: no atexit
    """
    env = {**os.environ, "PSKV_TIMELINE": str(path), "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    part = json.loads(Path(f"{path}.worker-0.json").read_text().rstrip().rstrip(",") + "]")  # a trace by itself
    assert [e["name"] for e in part[:2]] == ["process_name", "thread_name"] and len(part) >= 4000, part[:2]
    with open(f"{path}.worker-0.json", "a") as f:
        f.write('{"name": "cut sh')  # a process killed while it wrote
    assert timeline.merge(str(path)) == 1
    events = json.loads(path.read_text())["traceEvents"]
    assert sum(e["name"] == "send PUSH" for e in events) >= 4000, len(events)
    # in wall-clock time, which hosts share (perf_counter's epoch is each host's own: traces gathered from a
    # cluster did not line up)
    assert all(abs(e["ts"] / 1e6 - time.time()) < 600 for e in events if e["name"] == "send PUSH"), events[-1]
    assert not list(tmp_path.glob("t.json.*")), sorted(tmp_path.iterdir())


def test_a_path_it_cannot_write_is_said_at_start_in_one_line(tmp_path: Path) -> None:
    code = """if True:
        from pskv.ps import timeline
        timeline.start("worker", 0)
        timeline.span("send PUSH", timeline.now())
        print("on" if timeline.on else "off")
    """
    for path in (tmp_path, tmp_path / "missing" / "t.json"):  # a directory; a file in no directory
        env = {**os.environ, "PSKV_TIMELINE": str(path), "PYTHONPATH": str(REPO)}
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stdout == "off\n", res
        assert res.stderr.startswith(f"pskv worker 0: no timeline: PSKV_TIMELINE={path}: ") and "Traceback" not in res.stderr, res.stderr
        assert timeline.merge(str(path)) == 0


def test_a_forked_child_writes_none_of_its_parents_spans_again(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    code = """if True:
        import os
        from pskv.ps import timeline
        timeline.start("worker", 0)
        for i in range(10):
            timeline.span("parent's", timeline.now(), i=i)
        pid = os.fork()
        if pid == 0:  # the child ends normally: its atexit runs
            timeline.span("child's", timeline.now())
            raise SystemExit(0)
        assert os.waitpid(pid, 0)[1] == 0
    """
    env = {**os.environ, "PSKV_TIMELINE": str(path), "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert timeline.merge(str(path)) == 1
    events = json.loads(path.read_text())["traceEvents"]
    assert [e["args"]["i"] for e in events if e["name"] == "parent's"] == list(range(10)), events
    assert not [e for e in events if e["name"] == "child's"], "the child's spans would share the parent's process row"
