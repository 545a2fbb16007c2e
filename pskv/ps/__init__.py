"""The parameter-server system: scheduler, servers and the worker's client. ``serve()`` runs the scheduler or
a server as the ``DMLC_*`` environment says (``pskv serve``, ``pskv.kv.create("dist...")`` in such a process)."""

from __future__ import annotations

import sys
from typing import Optional

from ..errors import PSKVError
from .node import JobEnv


def serve(env: Optional[JobEnv] = None) -> int:
    """Run this process's role (scheduler or server) until the job ends; the exit status."""
    try:
        env = env or JobEnv.from_environ()
        if env.role == "scheduler":
            from .scheduler import Scheduler
            return Scheduler(env).run()
        if env.role == "server":
            from .server import Server
            return Server(env).run()
    except PSKVError as exc:
        print(f"pskv serve: {exc}", file=sys.stderr, flush=True)
        return 1
    print("pskv serve: DMLC_ROLE=worker; workers run the training program, not `pskv serve`", file=sys.stderr)
    return 2
