"""Shared fixtures: stores of every type, and whole jobs inside one process."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Optional

import pytest

from pskv.kv import KVStore


class InprocJob:
    """A scheduler and servers as threads of this process, talking over ``inproc://``.

    Workers are :class:`~pskv.kv.dist.DistStore`\\s made with :meth:`worker`, in this thread or
    in threads of :meth:`run_workers`. :meth:`join` checks every role exited with status 0.
    """

    def __init__(self, workers: int = 1, servers: int = 1):
        from pskv.ps.scheduler import Scheduler
        from pskv.ps.server import Server

        self.workers, self.servers = workers, servers
        self.root = f"inproc://pskv-test-{uuid.uuid4().hex[:10]}"
        self.codes: dict[str, Optional[int]] = {}
        self.threads: list[threading.Thread] = []
        self._start("scheduler", lambda: Scheduler(self.env("scheduler")).run())
        for s in range(servers):
            self._start(f"server {s}", lambda s=s: Server(self.env("server", server_id=s)).run())

    def env(self, role: str, **kw: Any) -> Any:
        from pskv.ps.node import JobEnv

        return JobEnv(role, self.root, 0, self.workers, self.servers, **kw)

    def _start(self, name: str, target: Callable[[], int]) -> None:
        def run() -> None:
            self.codes[name] = None
            self.codes[name] = target()

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def worker(self, store_type: str = "dist_sync", rank: Optional[int] = None) -> KVStore:
        from pskv.kv.dist import DistStore

        return DistStore(store_type, self.env("worker", worker_id=rank))

    def run_workers(self, fn: Callable[[KVStore], Any], store_type: str = "dist_sync", timeout: float = 60) -> list[Any]:
        """Run ``fn(store)`` in one thread per worker (store closed afterwards); results by rank."""
        results: dict[int, Any] = {}
        errors: list[BaseException] = []

        def body(rank: int) -> None:
            try:
                with self.worker(store_type, rank) as kv:
                    results[rank] = fn(kv)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in threads), "a worker thread hung"
        if errors:
            raise errors[0]
        return [results[r] for r in range(self.workers)]

    def join(self, timeout: float = 20) -> dict[str, Optional[int]]:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), f"roles still running: {self.codes}"
        return self.codes


@pytest.fixture
def inproc_job() -> Iterator[Callable[..., InprocJob]]:
    """``inproc_job(workers, servers)`` makes a job; every one made is joined at teardown."""
    jobs: list[InprocJob] = []

    def make(workers: int = 1, servers: int = 1) -> InprocJob:
        job = InprocJob(workers, servers)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.join()


# "dist_sync/tcp": the same store with shared memory switched off (PSKV_SHM=0), so both data
# paths meet every semantic test
STORE_TYPES = ["local", "device", "dist_sync", "dist_sync/tcp", "dist_device_sync"]


@pytest.fixture
def make_store(inproc_job: Callable[..., InprocJob], monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], KVStore]]:
    """``make_store(type)``: a fresh store; a dist type gets a one-worker, two-server job of its own."""
    import pskv

    made: list[KVStore] = []

    def make(store_type: str) -> KVStore:
        name, _, path = store_type.partition("/")
        if path == "tcp":
            monkeypatch.setenv("PSKV_SHM", "0")
        kv = inproc_job(1, 2).worker(name) if name.startswith("dist") else pskv.kv.create(name)
        if name.startswith("dist"):  # the path under test is the one taken
            import os

            assert bool(kv._shm_servers) == (os.environ.get("PSKV_SHM") != "0")  # type: ignore[attr-defined]
        made.append(kv)
        return kv

    yield make
    for kv in made:
        kv.close()


@pytest.fixture(params=STORE_TYPES)
def kv(request: pytest.FixtureRequest, make_store: Callable[[str], KVStore]) -> KVStore:
    """A store of each type in turn (dist types in an in-process job)."""
    return make_store(request.param)
