"""The scheduler: registration and ranks, barriers, heartbeats, failure notices, shutdown; control
messages only, never torch (docs/DESIGN.md, "Processes" and "Never a silent hang", tells its life)."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Optional

from .. import config
from ..errors import ClusterError, deadline, describe_node, finished_without, node_failed
from .message import MAX_META, Message, Type, error_reply, json_frame
from .node import JobEnv, lost_launcher, say, watch_launcher
from .van import PeerGone, Van


@dataclass
class _Node:
    peer: str
    role: str
    meta: dict[str, Any]
    rank: int = -1
    last_seen: float = field(default_factory=time.monotonic)
    finished: bool = False
    closed: float = 0.0  # when its connection was seen to close (0: not since its last message)
    lost: bool = False  # a worker that failed, and the job went on without it (PSKV_MIN_WORKERS)
    joining: bool = False  # a worker in a lost one's place, a member from the workers' next allgather

    def info(self) -> dict[str, Any]:
        """This node's row of the node table."""
        shared = ("endpoint", "host", "hostname", "pid", "shm_host", "max_frame")
        return {"role": self.role, "rank": self.rank, **{k: self.meta.get(k) for k in shared}}

    def __str__(self) -> str:
        return describe_node(self.info())


@dataclass
class _Barrier:
    started: float
    waiting: dict[str, Message] = field(default_factory=dict)  # peer -> its BARRIER request


class Scheduler:
    """Runs the scheduler of one job; :meth:`run` returns the process exit status."""

    def __init__(self, env: JobEnv):
        self.env = env
        self.van = Van("scheduler")
        watch_launcher(self.van)
        self.nodes: dict[str, _Node] = {}
        self.started = False
        self.barriers: dict[str, _Barrier] = {}
        self.status: Optional[int] = None
        self.timeout, self.hb_timeout = config.timeout(), config.heartbeat_timeout()
        self.min_workers, self.replicas = config.min_workers(), config.replicas()
        self._pipe: Optional[IO[str]] = None  # to pskv launch (PSKV_PORT_FD)
        self.admits: dict[str, Message] = {}  # joining worker -> its first BARRIER (an allgather)
        self.acks: Optional[set[str]] = None  # the servers yet to count the joining workers in
        self.refused: list[str] = []  # the nodes refused at registration, and why

    def _members(self, group: str) -> list[_Node]:
        """The nodes of ``group`` ("server", "worker" or "all"), servers first, by rank."""
        if group not in ("server", "worker", "all"):
            raise ClusterError(f"unknown barrier group {group!r}")
        nodes = [n for n in self.nodes.values() if group in (n.role, "all") and not n.lost and not n.joining]
        return sorted(nodes, key=lambda n: (n.role, n.rank))  # "server" < "worker"

    def _broadcast(self, msg: Message, roles: tuple[str, ...] = ("server", "worker")) -> None:
        for node in self.nodes.values():
            if node.role in roles and not node.finished:
                self.van.post(node.peer, msg)

    def run(self) -> int:
        bound = self.bound = self.van.listen(self.env.scheduler_endpoint, max_frame=MAX_META)
        # tell pskv launch (PSKV_PORT_FD) our port; later, that the job started (from then on it may go on
        # without a lost node: --replicas, --min-workers), and which nodes were lost
        if (fd := os.environ.get("PSKV_PORT_FD")) and not self.env.inproc:
            self._pipe = os.fdopen(int(fd), "w")
            self._tell(bound.rsplit(":", 1)[1])
        say("scheduler", f"listening on {bound}, waiting for {self.env.num_servers} servers and {self.env.num_workers} workers")
        start_deadline = time.monotonic() + config.start_timeout()
        try:
            while self.status is None:
                for peer, msg in self.van.recv(0.25):
                    if isinstance(msg, PeerGone):
                        self._gone(peer)
                    elif isinstance(msg, Exception):
                        self.van.post(peer, error_reply(None, msg))
                    else:
                        try:
                            self._handle(peer, msg)
                        except ClusterError as exc:
                            self.van.post(peer, error_reply(msg, exc))
                            if msg.type == Type.REGISTER:  # (said here, and again if the start fails: why that node never came)
                                who = msg.meta or {}
                                self.refused.append(f"{who.get('role')} on {who.get('hostname')} (pid {who.get('pid')}): {exc}")
                                print(f"pskv scheduler: refused a {self.refused[-1]}", file=sys.stderr, flush=True)
                now = time.monotonic()
                if not self.started and now > start_deadline:
                    self._fail_start()
                self._check_heartbeats()  # (before the start only closed connections: nodes send heartbeats from REGISTER on)
                if self.started:
                    self._check_barriers(now)
        finally:
            self.van.close(linger=2.0)
        say("scheduler", f"exiting with status {self.status}")
        return self.status

    def _tell(self, line: str) -> None:
        if self._pipe is not None:
            with contextlib.suppress(OSError):  # the launcher is gone: its lifeline tells us too
                print(line, file=self._pipe, flush=True)

    def _handle(self, peer: str, msg: Message) -> None:
        if (node := self.nodes.get(peer)) is not None:
            node.last_seen, node.closed = time.monotonic(), 0.0
        if msg.type == Type.REGISTER:
            return self._register(peer, msg)
        if node is None:
            raise ClusterError(f"{msg.type.name} from a node that has not registered")
        if msg.type == Type.HEARTBEAT:
            self.van.post(node.peer, Message(Type.HEARTBEAT_ACK))
        elif msg.type == Type.BARRIER:
            self._barrier(node, msg)
        elif msg.type == Type.FINALIZE:
            self._finalize(node, msg)
        elif msg.type == Type.OK and self.acks is not None and node.role == "server":  # to WORKER_BACK
            self.acks.discard(peer)
            for group in list(self.barriers):
                self._release(group)
        else:
            raise ClusterError(f"the scheduler does not handle {msg.type.name}")

    def _register(self, peer: str, msg: Message) -> None:
        meta = msg.meta or {}
        role = meta.get("role")
        if role not in ("server", "worker"):
            raise ClusterError(f"cannot register role {role!r}")
        if (counts := meta.get("counts")) != (ours := [self.env.num_servers, self.env.num_workers]):  # (a server's sums rounds of its count)
            raise ClusterError(f"this {role} has [DMLC_NUM_SERVER, DMLC_NUM_WORKER] = {counts}, the scheduler {ours}: every process "
                               "of a job must be started with the same counts")
        if role == "worker":
            self._check_placement(meta)
        want = self.env.num_servers if role == "server" else self.env.num_workers
        workers = [n for n in self.nodes.values() if n.role == "worker"]
        lost = sorted({n.rank for n in workers if n.lost} - {n.rank for n in workers if not n.lost}) if self.started and role == "worker" else []
        if lost and meta.get("id") in (None, *lost):
            return self._rejoin(peer, meta, lost[0] if meta.get("id") is None else meta["id"])
        if self.started or len(self._members(role)) >= want:
            raise ClusterError(f"the job already has its {want} {role}s; refusing {role} from host {meta.get('host')} "
                               f"pid {meta.get('pid')}")
        if (wanted := meta.get("id")) is not None:
            if not isinstance(wanted, int) or not 0 <= wanted < want:
                raise ClusterError(f"{role} id {wanted!r} is out of range 0..{want - 1}")
            if twin := [n.meta for n in self._members(role) if n.meta.get("id") == wanted]:
                raise ClusterError(f"DMLC_{role.upper()}_ID={wanted} again: the {role} on {twin[0].get('hostname')} (pid "
                                   f"{twin[0].get('pid')}) has it; each {role} needs its own")
        self.nodes[peer] = _Node(peer, role, meta, -1 if wanted is None else wanted)  # (the rank asked for is its rank)
        say("scheduler", f"{role} registered from {meta.get('hostname')} pid {meta.get('pid')}")
        self._tell(f"registered {role}")
        if len(self._members("server")) == self.env.num_servers and len(self._members("worker")) == self.env.num_workers:
            self._start()

    def _check_placement(self, meta: dict[str, Any]) -> None:
        """A worker whose keys' parts would go elsewhere than the first worker's (or, PSKV_REPLICAS,
        be kept otherwise than the scheduler expects: it went on after a lost server with no copy), or that
        expects the job to outlive a worker otherwise (PSKV_MIN_WORKERS: set on the workers alone, it did nothing), is refused."""
        first = next((n.meta for n in self.nodes.values() if n.role == "worker"), meta)
        ours = {"PSKV_REPLICAS": self.replicas, "PSKV_MIN_WORKERS": self.min_workers}
        theirs, agreed = meta.get("placement") or {}, {**(first.get("placement") or {}), **ours}
        if wrong := [k for k in agreed if theirs.get(k) != agreed[k]]:
            name = wrong[0]
            by = "the scheduler" if name in ours else f"the worker on {first.get('hostname')} (pid {first.get('pid')})"
            raise ClusterError(f"this worker has {name}={theirs.get(name)}, {by} {agreed[name]}: every worker of a job (and the "
                               "scheduler, for PSKV_REPLICAS and PSKV_MIN_WORKERS) must be started with the same")

    def _start(self) -> None:
        for role in ("server", "worker"):
            nodes = [n for n in self.nodes.values() if n.role == role]  # registration order
            free = iter(sorted(set(range(len(nodes))) - {n.rank for n in nodes}))  # (a node that asked for an id has it as its rank)
            for n in [n for n in nodes if n.rank < 0]:
                n.rank = next(free)
        self.started = True
        self._tell("started")  # first: pskv launch knows before a worker can have finished (ProcessContext.wait)
        for n in self.nodes.values():
            n.last_seen = time.monotonic()
        self._send_table([(n.peer, n.rank) for n in self.nodes.values()])
        say("scheduler", "all nodes registered; job started")

    def _send_table(self, to: list[tuple[str, int]], **meta: Any) -> None:
        """The node table, every rank's latest node (a lost server's marked: a worker that rejoins skips it), to each
        (peer, its rank); in a JSON frame (a row per node: thousands are over MAX_META), encoded once."""
        latest = {(n.role, n.rank): {**n.info(), **({"lost": True} if n.lost else {})} for n in self.nodes.values()}
        table = json_frame({f"{role}s": [latest[k] for k in sorted(latest) if k[0] == role] for role in ("server", "worker")})
        for peer, rank in to:  # heartbeat: how often we need to hear from each node (PSKV_HEARTBEAT_*)
            self.van.post(peer, Message(Type.NODES, meta={"rank": rank, "heartbeat": config.heartbeat_interval(), **meta}, frames=[table]))

    def _rejoin(self, peer: str, meta: dict[str, Any], rank: int) -> None:
        """A worker registers in the place of lost worker ``rank`` (pskv launch --max-restarts): it
        gets that rank now, and is admitted at the workers' next allgather (see ``_release``)."""
        node = self.nodes[peer] = _Node(peer, "worker", meta, rank, joining=True)
        self._send_table([(node.peer, rank)], rejoined=True)
        self._tell(f"back worker {rank}")  # (pskv launch stops one still starting when the job ends)
        say("scheduler", f"worker {rank} is back from {meta.get('hostname')} pid {meta.get('pid')}; it joins at the next allgather")

    def _fail_start(self) -> None:
        have_s, have_w = len(self._members("server")), len(self._members("worker"))
        ids = {(n.role, n.meta.get("id")) for n in self.nodes.values()}
        absent = [f"{r} {i}" for r, want in (("server", self.env.num_servers), ("worker", self.env.num_workers))
                  for i in range(want) if (r, i) not in ids and (r, None) not in ids]  # fmt: skip
        missing = (f"every node to register: {have_s} of {self.env.num_servers} servers and {have_w} of "
                   f"{self.env.num_workers} workers registered with the scheduler at {self.bound}"
                   f"{'; not registered: ' + ', '.join(absent[:16]) if absent else ''}{f' and {len(absent) - 16} more' if len(absent) > 16 else ''}"
                   f"{'' if have_w else ' (no worker made a dist store yet: a program that needs no servers runs with -s 0)'}"
                   f"{'; refused: a ' + '; a '.join(self.refused[-3:]) if self.refused else ''}")
        exc = deadline("the job's start", config.start_timeout(), "PSKV_START_TIMEOUT", config.start_timeout(), missing)
        for n in self.nodes.values():
            self.van.post(n.peer, error_reply(None, exc))
        print(f"pskv scheduler: {exc}", file=sys.stderr, flush=True)
        self.status = 1

    def _barrier(self, node: _Node, msg: Message) -> None:
        group, meta = str((msg.meta or {}).get("group", "worker")), msg.meta or {}
        if "replaces" in meta:  # the worker's barrier before was cut short (an interrupt): this request takes its place
            held = self.admits if node.joining else self.barriers[group].waiting if group in self.barriers else {}
            if (earlier := held.get(node.peer)) is None or earlier.req_id != meta["replaces"]:  # answered already (released): its answer is this one's
                return self.van.post(node.peer, msg.reply(Type.OK, meta={"earlier": True}))
            self.van.post(node.peer, error_reply(earlier, ClusterError("barrier: replaced by a later one of this worker")))  # (no one waits for it)
        if node.joining:
            if "value" not in meta:  # the others' barrier would take it for theirs
                raise ClusterError(f"{node} is back in a lost worker's place and joins at the others' next allgather; "
                                   "a plain barrier() before it admits no one (SPEC: a worker back)")
            self.admits[node.peer] = msg
            return
        if gone := [n for n in self._members(group) if n.finished]:
            raise finished_without(", ".join(map(str, gone)), f"reaching the barrier of the {group}s")
        self.barriers.setdefault(group, _Barrier(time.monotonic())).waiting[node.peer] = msg
        self._release(group)

    def _release(self, group: str) -> None:
        members, bar = self._members(group), self.barriers[group]
        if not all(n.peer in bar.waiting for n in members):
            return
        if self.admits and group != "server" and all("value" in (bar.waiting[n.peer].meta or {}) for n in members):
            # an allgather admits the workers waiting to rejoin; first, the servers count them in
            live = {n.peer for n in self._members("server")}
            if self.acks is None:
                self.acks = live
                ranks = sorted(self.nodes[p].rank for p in self.admits)
                self._broadcast(Message(Type.WORKER_BACK, meta={"ranks": ranks}), roles=("server",))
            if self.acks & live:
                return
            for peer, req in self.admits.items():
                self.nodes[peer].joining, bar.waiting[peer] = False, req
            self.admits, self.acks = {}, None
            members = self._members(group)
        del self.barriers[group]
        # a barrier may carry a small JSON value per node: everyone gets all of them, by rank
        values = [(bar.waiting[n.peer].meta or {}).get("value") for n in members]
        meta = {"values": values} if any("value" in (bar.waiting[n.peer].meta or {}) for n in members) else None
        for n in members:
            self.van.post(n.peer, bar.waiting[n.peer].reply(Type.OK, meta=meta))

    def _fail_barrier(self, group: str, exc: Exception) -> None:
        bar = self.barriers.pop(group)
        for peer, req in bar.waiting.items():
            self.van.post(peer, error_reply(req, exc))

    def _check_barriers(self, now: float) -> None:
        for group, bar in list(self.barriers.items()):
            if now - bar.started > self.timeout:
                missing = [n.rank for n in self._members(group) if n.peer not in bar.waiting]
                here = sorted(self.nodes[p].rank for p in bar.waiting)
                gap = f"{group} ranks {missing} (arrived: {here})"
                self._fail_barrier(group, deadline("the barrier", now - bar.started, "PSKV_TIMEOUT", self.timeout, gap))

    def _finalize(self, node: _Node, msg: Message) -> None:
        if node.role != "worker":
            raise ClusterError("only workers finalize")
        self.van.post(node.peer, msg.reply(Type.OK))
        if (failed := (msg.meta or {}).get("failed")) and not node.lost:  # it dies of an uncaught exception: lost, not finished
            return self._lost(node, f"it exited with an uncaught {failed}")
        node.finished = True
        say("scheduler", f"{node} finished")
        if node.lost or node.joining:  # the rounds go on without it already
            return
        self._broadcast(Message(Type.WORKER_LEFT, meta={"rank": node.rank}), roles=("server",))
        for group in list(self.barriers):
            if node in self._members(group):
                self._fail_barrier(group, finished_without(str(node), f"reaching the barrier of the {group}s"))
        self._shutdown_when_done()

    def _shutdown_when_done(self) -> None:
        if all(n.finished for n in self._members("worker")):
            self._tell("ended")
            for node in [n for n in self.nodes.values() if n.joining]:  # too late to rejoin
                exc = ClusterError(f"the job ended (every other worker finished) before {node} could rejoin it")
                self.van.post(node.peer, error_reply(self.admits.pop(node.peer, None), exc))
                self._let_go(node, str(exc))
            self._broadcast(Message(Type.SHUTDOWN), roles=("server",))
            self.status = 0

    def _check_heartbeats(self) -> None:
        for node in self.nodes.values():
            silent = self.van.polled - node.last_seen  # (not the time now: what waits unread is not silence)
            if self.started and not node.finished and silent > self.hb_timeout:
                heard = min(self.van.polled - n.last_seen for n in self.nodes.values() if not n.finished)  # from anyone
                alone = f"; no node has been heard for {heard:.1f} s: is this scheduler's host cut off?" if heard > 3 * config.heartbeat_interval() else ""
                return self._lost(node, f"no heartbeat for {silent:.1f} s (PSKV_HEARTBEAT_TIMEOUT={self.hb_timeout:g}){alone}")
            if not node.finished and node.closed and self.van.polled - node.closed > 3 * config.heartbeat_interval():
                return self._lost(node, "its connection to the scheduler closed: the process exited or was killed")

    def _gone(self, peer: str) -> None:
        """The launcher's lifeline ended: stop. A node's connection closed: it is lost unless it still
        sends (a heartbeat within three intervals: see ``Van._closed``)."""
        node = self.nodes.get(peer)
        if peer.startswith("launcher"):
            print(f"pskv scheduler: {lost_launcher(peer, 'the scheduler')}", file=sys.stderr, flush=True)
            self.status = 1
        elif node is not None:
            node.closed = time.monotonic()

    def _let_go(self, node: _Node, text: str) -> None:
        print(f"pskv scheduler: {text}", file=sys.stderr, flush=True)
        node.lost, node.joining, node.finished = True, False, True
        self._tell(f"lost {node.role} {node.rank}")  # pskv launch lets its process go (or starts it anew)

    def _go_on_without(self, node: _Node, text: str, notice: Message, role: str) -> None:
        """The job goes on without ``node``: it is a member of nothing now; ``notice`` tells the ``role``s."""
        self._let_go(node, text)
        self._broadcast(notice, roles=(role,))
        for group in list(self.barriers):
            self._release(group)
        self._shutdown_when_done()

    def _lost(self, node: _Node, reason: str) -> None:
        """``node`` failed: the job goes on without it if it may (a replica, ``--min-workers``), else ends."""
        exc = node_failed(node.info(), reason if self.started else f"{reason}, before the job started")
        if node.joining and self.acks is not None and node.peer in self.admits:
            return  # being admitted: lost as a member, once it is one
        if node.joining:  # not a member yet: nothing waits for it
            self.admits.pop(node.peer, None)
            return self._let_go(node, f"{exc}; it was rejoining the job")
        left = len(self._members(node.role)) - 1  # (lost nodes are members of nothing)
        if self.started and node.role == "server" and left > 0 and self.env.num_servers - left <= self.replicas:  # lost, this one too: at most R
            live = {n.rank for n in self._members("server")} - {node.rank}
            backup = next(b for b in ((node.rank + i) % self.env.num_servers for i in range(1, self.env.num_servers)) if b in live)
            note = f"server {backup}, its backup, serves its parts (PSKV_REPLICAS={self.replicas})"
            return self._go_on_without(node, f"{exc}; {note}", Message(Type.SERVER_LOST, meta={"rank": node.rank}), "worker")
        if self.started and node.role == "worker" and 0 < self.min_workers <= left:
            note = f"the job goes on with {left} workers (PSKV_MIN_WORKERS={self.min_workers})"
            return self._go_on_without(node, f"{exc}; {note}", Message(Type.WORKER_LEFT, meta={"rank": node.rank, "lost": True}), "server")
        print(f"pskv scheduler: {exc}", file=sys.stderr, flush=True)
        self._broadcast(Message(Type.NODE_FAILED, meta={**node.info(), "reason": reason}) if self.started else error_reply(None, exc))  # (to it too: stopped, it learns so once it goes on)
        self.status = 1
