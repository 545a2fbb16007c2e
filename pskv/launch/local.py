"""``pskv launch --launcher local``: the scheduler, servers and workers all on this machine
(docs/launchers/local.md); :func:`launch_local` runs such a job for ``pskv train`` and ``pskv bench``."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Optional

from .job import Backend, Planned, Show, run_job
from .spec import ROLES, SERVE, JobSpec, free_port


class Local(Backend):
    address = "127.0.0.1"
    guarded = False  # it stops with the job like the servers: no guard needed on this machine

    def __init__(self, spec: JobSpec, quiet: bool = False):
        super().__init__(spec)
        self.quiet = quiet
        self.scheduler_show: Show = "tail" if quiet else "prefix"  # quiet: keep only the last lines, for a failure report

    def processes(self, port: Optional[int]) -> list[Planned]:
        spec, here, n, show = self.spec, self.address, self.spec.num_workers, self.scheduler_show
        out = [
            Planned(f"server {s}", SERVE, spec.process_env("server", here, port, s, base=spec.environ), show=show)
            for s in range(spec.num_servers)
        ]
        torch = {"LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": here, "MASTER_PORT": str(free_port())}
        for w in range(n):
            env = spec.process_env("worker", here, port, w, base=spec.environ, torch={**torch, "LOCAL_RANK": str(w)})
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
            out.append(Planned(f"worker {w}", spec.argv("worker"), env, main=True, show="raw" if self.quiet and w == 0 else show))
        return out


def launch_local(
    num_workers: int, num_servers: int, command: Sequence[str], extra_env: Optional[Mapping[str, str]] = None,
    role_extra: Optional[Mapping[str, Mapping[str, str]]] = None, timeout: Optional[float] = None,
    quiet: bool = False, peak_rss_mb: Optional[dict[str, float]] = None, secret: bool = True,
) -> int:  # fmt: skip
    """Run a job on this machine until it ends; the exit status. ``role_extra``: env by role; ``quiet``:
    only worker 0's output, as it is; ``peak_rss_mb`` receives each process's peak memory by name;
    ``secret=False``: a job without a secret (to measure what authentication costs)."""
    role_env = {r: dict((role_extra or {}).get(r, {})) for r in ROLES}
    spec = JobSpec(num_workers, num_servers, list(command), dict(extra_env or {}), role_env, timeout=timeout, secret=None if secret else "")
    local = Local(spec, quiet)
    status = run_job(spec, local)
    if peak_rss_mb is not None and local.ctx is not None:
        peak_rss_mb.update({p.name: p.peak_rss_mb for p in local.ctx.procs})
    return status
