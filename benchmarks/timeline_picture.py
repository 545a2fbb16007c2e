#!/usr/bin/env python3
"""One training step of 2 workers x 2 servers as the timeline shows it: overlap off and on.

Runs ``benchmarks/train_step.py``'s pskv configuration twice with ``PSKV_TIMELINE`` (the Trainer's
exchange as a barrier after backward, then overlapped with backward and the next forward), keeps
both merged traces and draws worker 0 and the servers over one step (from a forward to the next)
into one PNG: the "before" and "after" of the exchange as a pipeline.

    .venv/bin/python benchmarks/timeline_picture.py [--device cpu] [--batch 32] [--out benchmarks/timeline_step.png]

On one host the servers are reached over TCP (``PSKV_SHM=0``), as they would be on other hosts,
where the Trainer turns overlap on by itself. Open the kept traces in https://ui.perfetto.dev.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

COLORS = {"forward": "#4c72b0", "backward": "#55a868", "push": "#dd8452", "send": "#c44e52", "answer": "#8172b3",
          "wait": "#937860", "step": "#da8bc3", "PUSH": "#dd8452", "PULL": "#64b5cd"}  # fmt: skip


def color(name: str) -> str:
    for prefix, c in COLORS.items():
        if name.startswith(prefix) or name.split(" ")[0] == prefix:
            return c
    return "#8c8c8c"


def one_step(trace: dict[str, Any]) -> tuple[list[tuple[str, list[dict[str, Any]]]], float, float]:
    """The rows to draw (worker 0's threads, then each server's) and the window of worker 0's
    second-to-last step: from its forward to the next forward."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    forwards = sorted(e["ts"] for e in events if e["pid"] == 1000 and e["name"] == "forward")
    if len(forwards) < 3:
        raise SystemExit("timeline_picture: the trace has fewer than 3 forward spans of worker 0")
    begin, end = forwards[-3], forwards[-2]
    rows: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in events:
        if (e["pid"] == 1000 or 100 <= e["pid"] < 1000) and e["ts"] < end and e["ts"] + e["dur"] > begin:
            rows.setdefault((e["pid"], e["tid"]), []).append(e)
    labels = [(f"{procs.get(pid, pid)}: {names.get((pid, tid), tid)}", rows[(pid, tid)]) for pid, tid in sorted(rows, key=lambda k: (-(k[0] == 1000), k))]
    return labels, begin, end


def draw(traces: list[tuple[str, dict[str, Any]]], out: Path) -> None:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    steps = [(title, *one_step(trace)) for title, trace in traces]
    height = sum(len(rows) for _, rows, _, _ in steps) * 0.42 + 1.6 * len(steps)
    fig = Figure(figsize=(13, height))
    axes = fig.subplots(len(steps), 1, gridspec_kw={"height_ratios": [len(s[1]) + 1.5 for s in steps]})
    width = max(end - begin for _, _, begin, end in steps) / 1000
    for ax, (title, rows, begin, end) in zip(axes, steps):
        for y, (_, spans) in enumerate(rows):
            bars = [((max(e["ts"], begin) - begin) / 1000, (min(e["ts"] + e["dur"], end) - max(e["ts"], begin)) / 1000) for e in spans]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=[color(e["name"]) for e in spans], linewidth=0)
        ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
        ax.invert_yaxis()
        ax.set_xlim(0, width)
        ax.set_title(f"{title}: {(end - begin) / 1000:.0f} ms from forward to the next forward", fontsize=10, loc="left")
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("ms")
    kinds = ["forward", "backward", "push", "send", "answer", "wait", "step", "PULL"]
    fig.legend(handles=[Patch(color=COLORS[k], label=k) for k in kinds], loc="upper center", ncol=len(kinds), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(out, dpi=110)


def main() -> int:
    import train_step

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", type=Path, default=HERE / "timeline_step.png")
    args = p.parse_args()
    os.environ.setdefault("PSKV_SHM", "0")
    traces = []
    for overlap, title in (("off", "before: the exchange after backward"), ("on", "after: pushes during backward, pulls before each layer")):
        trace = args.out.with_name(f"{args.out.stem}_overlap_{overlap}.json")
        run = argparse.Namespace(device=args.device, batch=args.batch, steps=args.steps, warmup=2, overlap=overlap, trace=str(trace))
        result = train_step.run(run, "pskv", 2, 2)
        traces.append((f"{title} (overlap {overlap}, median step {1000 * result['step_s']:.0f} ms)", json.loads(trace.read_text())))
    draw(traces, args.out)
    print(f"timeline_picture: wrote {args.out} and the traces beside it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
