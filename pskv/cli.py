"""The ``pskv`` command: ``launch``, ``serve``, ``train``, ``bench``. Subcommands import what they
need when they run, so ``pskv serve`` as a scheduler starts without loading torch."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Optional

from .errors import PSKVError


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # train and bench belong to the training application (pskv/app) and parse their own arguments
    # (train re-runs itself as the workers): the one place the core reaches the app
    if argv and argv[0] in ("train", "bench"):
        return int(importlib.import_module(f"pskv.app.{argv[0]}").main(argv[1:]))
    from . import launch
    parser = argparse.ArgumentParser(prog="pskv", description="Parameter-server training for PyTorch.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    launch.add_parser(sub)
    sub.add_parser("train", help="train ResNet-18 with several workers and servers (see pskv train --help)", add_help=False)
    sub.add_parser("bench", help="time push/pull rounds against gloo all-reduce (see pskv bench --help)", add_help=False)
    serve_about = "Run this process's role (DMLC_ROLE=scheduler or server) until the job ends."
    sub.add_parser("serve", help="run the scheduler or a server as DMLC_ROLE says", description=serve_about)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "launch":
            return launch.run(args)
        from .ps import serve
        return serve()
    except PSKVError as exc:
        print(f"pskv {args.cmd}: {exc}", file=sys.stderr)
        return 2
