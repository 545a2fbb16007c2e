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

    def __init__(self, workers: int = 1, servers: int = 1, tcp: bool = False, host: str = "127.0.0.1"):
        from pskv.launch.spec import free_port
        from pskv.ps.scheduler import Scheduler
        from pskv.ps.server import Server

        self.workers, self.servers = workers, servers
        self.root = host if tcp else f"inproc://pskv-test-{uuid.uuid4().hex[:10]}"
        self.port = free_port() if tcp else 0  # tcp: the same threads, over 127.0.0.1 (or ``host``)
        self.codes: dict[str, Optional[int]] = {}
        self.threads: list[threading.Thread] = []
        self._start("scheduler", lambda: Scheduler(self.env("scheduler")).run())
        for s in range(servers):
            self._start(f"server {s}", lambda s=s: Server(self.env("server", server_id=s)).run())

    def env(self, role: str, **kw: Any) -> Any:
        from pskv.ps.node import JobEnv

        return JobEnv(role, self.root, self.port, self.workers, self.servers, **kw)

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

    def make(workers: int = 1, servers: int = 1, tcp: bool = False, host: str = "127.0.0.1") -> InprocJob:
        job = InprocJob(workers, servers, tcp, host)
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.join()


class OfflineServer:
    """A 2-worker server whose transport is a recorder; both workers said HELLO."""

    def __init__(self) -> None:
        import os

        from pskv.ps.message import Message, Type
        from pskv.ps.node import JobEnv
        from pskv.ps.server import Server

        self.server = Server(
            JobEnv("server", "inproc://pskv-fuzz", 0, num_workers=2, num_servers=1, server_id=0)
        )
        self.server.rank, self.server.workers = 0, [{"pid": os.getpid()}, {"pid": os.getpid()}]
        self.replies: list[tuple[str, Any]] = []
        self.server.van.send = lambda peer, msg, track=False: self.replies.append((peer, msg))  # type: ignore[method-assign]
        for rank in (0, 1):
            self.send(f"w{rank}", Message(Type.HELLO, meta={"rank": rank, "answers": True}))
        assert [m.type for _, m in self.replies] == [Type.OK, Type.OK]

    def send(self, peer: str, msg: Any) -> list[Any]:
        from pskv.ps.message import encode

        self.deliver(peer, encode(msg))
        return [m for p, m in self.replies if p == peer]

    def deliver(self, peer: str, frames: list[Any]) -> None:
        from pskv.errors import ProtocolError
        from pskv.ps.message import decode

        try:
            msg: Any = decode(frames)
        except ProtocolError as exc:
            msg = exc
        self.server._dispatch(peer, msg)
        self.server._flush()


@pytest.fixture
def offline_server(monkeypatch: pytest.MonkeyPatch) -> Callable[[], OfflineServer]:
    """``offline_server()``: a server of a 2-worker job without sockets (:class:`OfflineServer`)."""
    monkeypatch.setenv("PSKV_SHM", "0")  # no arena is mapped: fuzzed fds must never reach one
    return OfflineServer


# "dist_sync/tcp": the same store with shared memory switched off (PSKV_SHM=0), so both data
# paths meet every semantic test; "dist_device_sync" runs with a job secret (authenticated connections)
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
        if name == "dist_device_sync":
            monkeypatch.setenv("PSKV_SECRET", "semantic-tests-secret")
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
