"""A server's parts and their rounds, as a pure state machine: no sockets, no threads
(docs/DESIGN.md, "A round of dist_sync", tells the rules)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Optional, TypeVar

import torch
from torch import Tensor

from ..errors import (
    KeyNotInitializedError,
    NodeFailedError,
    OptimizerError,
    OptimizerRequiredError,
    ProtocolError,
    PSKVError,
    ShapeMismatchError,
    deadline,
    finished_without,
)
from ..ops import outside, reduce_values
from ..optim import KeyState, Optimizer, apply_push, updatable

ANSWER_BYTES = 4 << 20  # a pull that applies held updates answers what is done after about this many bytes of them


@dataclass(eq=False, slots=True)
class Answer:
    """One entry of a request: kept while it waits for its round or its value, then what to send for it."""

    req: Any  # who asked: the server's handle, opaque here
    entry: int = -1
    round: int = 0  # pulls and merge-acknowledgements: the round they wait for
    rows: Optional[Tensor] = None  # pulls of some rows only
    value: Optional[Tensor] = None  # a pull's data
    present: bool = False  # a pull into row-sparse outputs (PullEntry)
    part: Optional[Part] = None  # set when ``value`` is ``part.value`` itself (no copy was made)
    error: Optional[PSKVError] = None
    since: float = field(default_factory=time.monotonic)


class InitEntry(NamedTuple):
    key: int
    part: int
    name: str
    dtype: torch.dtype
    numel: int
    row_numel: int
    value: Optional[Tensor]  # worker 0's, flat


class PushEntry(NamedTuple):
    part: Part
    round: int
    grad: Tensor  # rows x row_numel, dense or row-sparse
    ack_when_merged: bool  # the bytes are the worker's (shared memory): it may reuse them once merged
    held: bool = False  # the round's update waits for the rescale a pull brings (Trainer.step)
    reply: bool = False  # answered with the value once its round is complete, not acknowledged
    rescale: Optional[float] = None  # (async) its update's, not the optimizer's


class PullEntry(NamedTuple):
    part: Part
    round: int
    rows: Optional[Tensor] = None  # int64 row ids local to the part, checked
    rescale: Optional[float] = None  # the rescale of a held round's update
    mirror: bool = False  # the copy a backup gets: it brings the rescale, and is only acknowledged
    present: bool = False  # into row-sparse outputs: the value with a last column, 1 for the rows it holds


E = TypeVar("E", PushEntry, PullEntry)


@dataclass(eq=False)
class Part:
    key: int
    index: int
    name: str
    dtype: torch.dtype
    numel: int
    row_numel: int
    mode: str  # "sync" | "async"
    state_key: int  # its optimizer state's key: the order in which this server first saw the parts
    value: Optional[Tensor] = None  # rows x row_numel, once worker 0's INIT arrived
    home: Any = None  # where the server keeps the value (its shared-memory slot), opaque here
    scratch: Optional[Tensor] = None  # where a round's pushes are summed before the optimizer runs
    initialised_by: set[int] = field(default_factory=set)  # the workers that sent INIT while the value is missing
    inits: list[Answer] = field(default_factory=list)  # INITs answered when the value arrives
    rounds: int = 0  # rounds completed
    pushed: dict[int, int] = field(default_factory=dict)  # worker -> pushes accepted from it
    base: dict[int, int] = field(default_factory=dict)  # worker -> the rounds before it rejoined (it counts from 0)
    queued: dict[int, list[tuple[Tensor, Optional[Answer], bool]]] = field(default_factory=dict)  # not merged yet (lists: a deque is 760 B)
    held: Optional[Tensor] = None  # a round's merged gradient waiting for its rescale
    present: Optional[Tensor] = None  # the rows of the last round, when it was a row-sparse push without an optimizer
    rescale: Optional[tuple[int, float]] = None  # (round, rescale) the round's first pull brought (the others must agree)
    pulls: list[Answer] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.numel // self.row_numel

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"key {self.name} part {self.index}"


class Rounds:
    """Every part one server holds, its rounds and the requests that wait on them. Single-threaded: each
    method checks a whole request before changing anything and returns the answers to send now.
    ``storage(part)`` makes room for a part's value (``rows x row_numel``); ``timeout``: ``PSKV_TIMEOUT``."""

    def __init__(self, num_workers: int, timeout: float, storage: Optional[Callable[[Part], Tensor]] = None):
        self.workers = list(range(num_workers))  # those whose pushes a round sums
        self.timeout = timeout
        self.storage = storage or (lambda p: torch.empty(p.rows, p.row_numel, dtype=p.dtype))
        self.parts: dict[tuple[int, int], Part] = {}
        self.optimizer: Optional[Optimizer] = None
        self.finished: set[int] = set()  # workers that closed their store
        self.waiting: dict[Part, None] = {}  # the parts where a pull or an INIT may wait (a dict: in the order they came)

    def part(self, key: int, index: int) -> Part:
        """The part ``(key, index)``, with its value (else :class:`KeyNotInitializedError`)."""
        p = self.parts.get((key, index))
        if p is None or p.value is None:
            raise KeyNotInitializedError(f"key {key} part {index} was never initialised on this server")
        return p

    def init(self, req: Any, rank: int, mode: str, entries: list[InitEntry]) -> list[Answer]:
        """Declare parts of a ``mode`` store (worker 0 sets their values); each is answered once it has its value."""
        if mode not in ("sync", "async"):
            raise ProtocolError(f"INIT for a store of mode {mode!r}")
        for e in entries:
            p = self.parts.get((e.key, e.part))
            if e.numel < 0 or e.row_numel < 1 or e.numel % e.row_numel:
                raise ProtocolError(f"bad INIT of key {e.name} part {e.part}: numel {e.numel}, row_numel {e.row_numel}")
            if (e.value is not None) != (rank == 0):
                raise ProtocolError(f"key {e.name}: worker 0 sends the init value, and only worker 0")
            if p is not None and (p.dtype, p.numel, p.row_numel, p.mode, p.name) != (e.dtype, e.numel, e.row_numel, mode, e.name):
                err = ShapeMismatchError(f"key {e.name} part {e.part}: worker {rank} initialised it as {e.numel} x {e.dtype} "
                                         f"({mode}), another worker as {p.numel} x {p.dtype} ({p.mode})"
                                         f"{'' if p.name == e.name else f' named {p.name}'}; every worker must "
                                         "create the same store type and init the same keys in the same order")
                waiting, p.inits = (p.inits, []) if p.value is None else ([], p.inits)  # (their value may never come)
                return [Answer(req, 0, error=err), *(replace(w, error=err) for w in waiting)]
        out: list[Answer] = []
        for i, e in enumerate(entries):
            p = self.parts.setdefault((e.key, e.part), Part(e.key, e.part, e.name, e.dtype, e.numel, e.row_numel, mode, len(self.parts)))
            p.initialised_by.add(rank)  # (again: its init cut short, by an interrupt or a deadline, is answered as the first)
            p.inits.append(Answer(req, i))
            if e.value is not None and p.value is None:
                p.value = self.storage(p)
                p.value.view(-1).copy_(e.value)
            if p.value is not None:
                out += p.inits
                p.inits = []
                p.initialised_by.clear()  # (read only while the value is late: 728 B a part for 8 workers)
            else:
                self.waiting[p] = None
        return out + self._fail_inits()

    def push(self, req: Any, rank: int, entries: list[PushEntry]) -> list[Answer]:
        """Queue (sync) or apply (async) pushed gradients; acknowledge each now or once merged."""
        entries = _from_base(rank, entries)
        latest: dict[int, int] = {}  # a part may come several times in one request: its rounds in order
        for e in entries:
            p = e.part
            if e.reply and p.mode == "sync" and (blocker := self._blocker(p, e.round)):  # (async: answered once applied)
                raise blocker
            if p.mode == "async" and self.optimizer is None:
                raise OptimizerRequiredError(f"key {p.name}: dist_async applies pushes on the servers and needs an "
                                             "optimizer; call set_optimizer first")
            if self.optimizer is not None:
                updatable(p.dtype, p)
            if p.mode == "sync" and rank in self.finished:
                raise NodeFailedError(f"worker {rank} pushed after it finished")
            if rank not in self.workers:
                raise NodeFailedError(f"worker {rank} was declared lost (PSKV_MIN_WORKERS): the job went on without it; "
                                      "a worker in its place pushes once admitted, at its first allgather")
            expected = latest.get(id(p), p.pushed.get(rank, 0)) + 1
            if e.round > expected and p.mode == "sync":  # async: rounds skipped by rejected pushes do not matter
                raise ProtocolError(f"{p}: worker {rank} pushed round {e.round} but its next round is {expected}")
            latest[id(p)] = max(expected - 1, e.round)
        out: list[Answer] = []
        touched: dict[int, Part] = {}
        for i, e in enumerate(entries):
            p = e.part
            if e.round < p.pushed.get(rank, 0) + 1:  # sent again (after a failover): applied once only
                out.append(Answer(req, i))
                continue
            p.pushed[rank] = e.round
            if p.mode == "async":
                assert p.value is not None
                apply_push(self.optimizer, p.state_key, e.grad, p.value, rescale=e.rescale)
                out.append(self._answer(p, Answer(req, i)) if e.reply else Answer(req, i))
                continue
            ack = Answer(req, i, e.round) if e.ack_when_merged and not e.reply else None
            p.queued.setdefault(rank, []).append((e.grad, ack, e.held))
            if e.reply:  # answered like a pull of its round (which comes after the merge)
                p.pulls.append(Answer(req, i, e.round))
                self.waiting[p] = None
            elif ack is None:
                out.append(Answer(req, i))
            touched[id(p)] = p
        for p in touched.values():
            out += self._complete(p)
            out += self._fail_blocked(p)
        return out

    def refused(self, rank: int, rows: Iterable[Any]) -> None:
        """Worker ``rank``'s push of ``rows`` was refused: the rounds it numbered are skipped (it numbers its
        later pushes on from them, and may have sent some before it heard): those count one lower."""
        for row in rows:
            p = self.parts.get((row.key, row.part))
            if p is not None and p.mode == "sync" and row.round + p.base.get(rank, 0) == p.pushed.get(rank, 0) + 1:
                p.base[rank] = p.base.get(rank, 0) - 1

    def _complete(self, p: Part) -> list[Answer]:
        """Merge every round of ``p`` that has one push from each worker; answer who waited for them.
        A held round stops here: its update waits for the rescale a pull brings."""
        out: list[Answer] = []
        while p.held is None and all(p.queued.get(r) for r in self.workers):
            entries = [p.queued[r].pop(0) for r in self.workers]
            for r in [r for r in self.workers if not p.queued[r]]:  # (a part with no push waiting: finish passes it over)
                del p.queued[r]
            out += [ack for _, ack, _ in entries if ack is not None]
            merged = self._merge(p, [g for g, _, _ in entries])
            held = merged is not None and any(h for _, _, h in entries)
            rescale = p.rescale[1] if held and p.rescale is not None and p.rescale[0] == p.rounds + 1 else None  # a pull of it came
            if held and (rescale is None or self.optimizer is None):
                p.held = merged  # (ends the loop)
            else:
                out += self._apply(p, merged, rescale)
        return out

    def _merge(self, p: Part, grads: list[Tensor]) -> Optional[Tensor]:
        """Sum one push of every worker: into the value itself when it replaces it (no optimizer, dense:
        None is returned), else into the part's scratch buffer (the optimizer needs no full-size temporaries)."""
        assert p.value is not None
        if any(g.is_sparse for g in grads):  # (row-sparse if every push is)
            return reduce_values(grads, p.value.device)
        if self.optimizer is None:
            _sum_into(p.value, grads)
            return None
        if p.scratch is None:
            p.scratch = torch.empty_like(p.value)
        return _sum_into(p.scratch, grads)

    def _apply(self, p: Part, merged: Optional[Tensor], rescale: Optional[float] = None) -> list[Answer]:
        """Apply a round's merged gradient (the optimizer, or assignment); the pulls it completes. A held
        round's ``rescale`` is for its update only: other parts' plain pushes keep the optimizer's own."""
        assert p.value is not None
        p.present = None if merged is None else apply_push(self.optimizer, p.state_key, merged, p.value, merged_is_scratch=merged is p.scratch,
                                                          rescale=rescale)  # fmt: skip
        p.rounds += 1
        ready = [w for w in p.pulls if w.round <= p.rounds]
        p.pulls = [w for w in p.pulls if w.round > p.rounds]
        if not p.pulls:  # (a part with its value has no INIT waiting)
            self.waiting.pop(p, None)
        return [self._answer(p, w) for w in ready]

    def pull(self, req: Any, rank: int, entries: list[PullEntry], early: Optional[Callable[[list[Answer]], None]] = None) -> list[Answer]:
        """Answer each entry now if its round is complete (async: always), else when it is. The
        answers so far go to ``early`` after every ``ANSWER_BYTES`` of held updates a pull makes."""
        entries = _from_base(rank, entries)
        for e in entries:
            p = e.part
            if p.mode == "sync" and e.round > p.pushed.get(rank, 0):
                raise ProtocolError(f"{p}: worker {rank} pulls round {e.round} but pushed only {p.pushed.get(rank, 0)}")
            if e.rows is not None and outside(e.rows, p.rows):
                raise ProtocolError(f"{p}: row ids outside [0, {p.rows})")
            if p.mode == "sync" and e.round > p.rounds and (blocker := self._blocker(p, e.round)):
                raise blocker
            if e.rescale is not None and p.rescale is not None and p.rescale[0] == e.round and p.rescale[1] != e.rescale:
                raise OptimizerError(f"{p}: worker {rank}'s Trainer.step scales round {e.round} by {e.rescale:g} (1/batch_size), another "
                                     f"worker's by {p.rescale[1]:g}: in dist_sync every worker must pass the same batch_size")
        out: list[Answer] = []
        updated = 0
        for i, e in enumerate(entries):
            p = e.part
            if early is not None and updated >= ANSWER_BYTES:
                early(out)
                out, updated = [], 0
            if e.rescale is not None and e.round == p.rounds + 1 and self.optimizer is not None:
                held, p.held, p.rescale = p.held, None, (e.round, e.rescale)  # (kept for when the round merges: its last push may never pull)
                if held is not None:  # the held round's update, with the rescale this pull brings
                    out += self._apply(p, held, e.rescale)
                    out += self._complete(p)
                    updated += p.nbytes
            w = Answer(req, i, e.round, e.rows, present=e.present)
            if e.mirror:
                out.append(w)
            elif p.mode == "async" or e.round <= p.rounds:
                out.append(self._answer(p, w))
            else:
                p.pulls.append(w)
                self.waiting[p] = None
        return out

    def _answer(self, p: Part, w: Answer) -> Answer:
        assert p.value is not None
        if w.rows is not None:
            w.value = p.value.index_select(0, w.rows)
        elif w.present:  # the rows every worker's row-sparse push of the round brought (zero sums too), else those not zero
            held = p.value.ne(0).any(1) if p.present is None else torch.zeros(p.rows, dtype=torch.bool).index_fill_(0, p.present, True)
            w.value = torch.cat([p.value, held.to(p.dtype).unsqueeze(1)], 1)
        elif p.mode == "async":
            w.value = p.value.clone()
        else:
            w.value, w.part = p.value, p
        return w

    def _blocker(self, p: Part, round: int) -> Optional[NodeFailedError]:
        """Why ``round`` of ``p`` can never complete (a worker finished without pushing it), or None."""
        missing = ", ".join(f"worker {r}" for r in sorted(self.finished) if p.pushed.get(r, 0) < round)
        return finished_without(missing, f"pushing key {p.name} for round {round - 1}") if missing else None

    def _fail_blocked(self, p: Part) -> list[Answer]:
        """Fail the pulls and merge-acknowledgements of ``p`` that wait for a round that cannot come."""
        if not self.finished:
            return []
        merged = p.rounds + (p.held is not None)  # rounds merged (a held one waits only for its rescale)
        reachable = merged + min(len(p.queued.get(r, ())) for r in self.finished)
        out = [replace(w, error=self._blocker(p, w.round)) for w in p.pulls if w.round > reachable]
        p.pulls = [w for w in p.pulls if w.round <= reachable]
        for q in p.queued.values():
            while len(q) > reachable - merged:
                _, ack, _ = q.pop()
                if ack is not None:
                    out.append(replace(ack, error=self._blocker(p, ack.round)))
        return out

    def finish(self, rank: int) -> list[Answer]:
        """Worker ``rank`` closed its store: fail every round that still needs it."""
        if rank not in self.workers:  # lost earlier: no round needs it
            return []
        self.finished.add(rank)  # (a part nothing waits on is passed over: each finish looked for its blocked rounds, parts x W^2 in all)
        return [a for p in self.parts.values() if p.pulls or any(p.queued.values()) for a in self._fail_blocked(p)] + self._fail_inits()

    def _fail_inits(self) -> list[Answer]:
        """Fail the inits that wait for a value worker 0 finished without sending (they waited ``PSKV_TIMEOUT``)."""
        out = []
        for p in self.parts.values() if 0 in self.finished else ():
            out += [replace(w, error=finished_without("worker 0", f"sending the init value of key {p.name}")) for w in p.inits]
            p.inits = []
        return out

    def lose(self, rank: int) -> list[Answer]:
        """Worker ``rank`` failed and the job goes on without it (``PSKV_MIN_WORKERS``): its pushes
        not merged yet are dropped, and rounds complete with the other workers' pushes."""
        self.workers.remove(rank)
        for p in self.parts.values():
            p.queued.pop(rank, None)
        return [a for p in self.parts.values() for a in self._complete(p)]

    def rejoin(self, rank: int) -> None:
        """Worker ``rank`` is back, in a lost one's place (``pskv launch --max-restarts``): every round
        from the next on needs its push; its round numbers start from 0 again. Called at an allgather,
        where each worker pulled what it pushed: every live worker pushed the same rounds."""
        self.workers = sorted({*self.workers, rank})
        self.finished.discard(rank)
        for p in self.parts.values():
            p.base[rank] = p.pushed[rank] = max(p.pushed.get(r, 0) for r in self.workers)

    def expire(self, now: float) -> list[Answer]:
        """Fail the requests that waited longer than the timeout, saying what they wait for."""
        self.waiting = dict.fromkeys(p for p in self.waiting if p.pulls or p.inits)  # (every 0.5 s: a look at all parts took 23 ms for 100,000)
        late = [p for p in self.waiting if any(now - w.since > self.timeout for w in (*p.pulls, *p.inits))]
        out = []
        for p in sorted(late, key=lambda p: (p.key, p.index)):
            for w in [w for w in p.pulls if now - w.since > self.timeout]:
                p.pulls.remove(w)
                missing = [r for r in self.workers if p.rounds + len(p.queued.get(r, ())) + (p.held is not None) < w.round]
                got = [r for r in self.workers if r not in missing]
                gap = f"round {w.round - 1}: workers {missing} have not pushed key {p.name} in that round (pushed: {got})"
                if not missing:
                    gap = f"round {w.round - 1} of key {p.name}: every worker pushed; its update waits for the rescale a pull of it brings"
                out.append(replace(w, error=deadline(f"the pull of {p}", now - w.since, "PSKV_TIMEOUT", self.timeout, gap)))
            for w in [w for w in p.inits if now - w.since > self.timeout]:
                p.inits.remove(w)
                gap = f"its value: worker 0 sends it and has not; workers that called init: {sorted(p.initialised_by)}"
                out.append(replace(w, error=deadline(f"the init of {p}", now - w.since, "PSKV_TIMEOUT", self.timeout, gap)))
        return out

    def fail_all(self, exc: PSKVError) -> list[Answer]:
        """The job is over (a node failed): fail everything that waits."""
        out = []
        for p in self.parts.values():
            acks = [ack for q in p.queued.values() for _, ack, _ in q if ack is not None]
            out += [replace(w, error=exc) for w in (*p.pulls, *p.inits, *acks)]
            p.pulls, p.inits = [], []
            p.queued.clear()
        return out

    def set_optimizer(self, desc: Any, keep_states: bool) -> None:
        """Install the optimizer ``desc`` describes (the same again: nothing changes), keeping its states
        with ``keep_states`` (new hyperparameters)."""
        new = Optimizer.from_description(desc)
        cur = self.optimizer
        if cur is not None and cur.describe() == new.describe():
            return
        if cur is not None and keep_states:
            if cur.name != new.name:
                raise OptimizerError(f"cannot change optimizer {cur.name!r} to {new.name!r} and keep its states")
            new.states, new.num_update = cur.states, cur.num_update
        self.optimizer = new

    def states(self) -> list[tuple[Part, KeyState]]:
        """Every part's optimizer state (parts no update reached yet have none)."""
        states = self.optimizer.states if self.optimizer is not None else {}
        return [(p, states[p.state_key]) for p in self.parts.values() if p.state_key in states]

    def load_states(self, desc: Any, num_update: int, entries: Iterable[tuple[Part, int, dict[str, Tensor]]]) -> None:
        """Saved states replace this server's, all checked first (an optimizer is set from ``desc`` if there is none)."""
        opt = self.optimizer if self.optimizer is not None else Optimizer.from_description(desc)
        if opt.name != desc.get("name"):
            raise OptimizerError(f"the states are for {desc.get('name')!r} but the servers run {opt.name!r}")
        new = {}
        for p, step, tensors in entries:
            opt.check_state(p.name, tensors, p.value if p.value is not None else torch.empty(0))
            new[p.state_key] = KeyState(step, {n: t.clone().view(p.rows, p.row_numel) for n, t in tensors.items()})
        self.optimizer = opt
        opt.states, opt.num_update = new, num_update  # they replace the ones before, as on local


def _from_base(rank: int, entries: list[E]) -> list[E]:
    """``entries`` with the rounds of a worker that rejoined (in a lost one's place) counted from the part's rounds before it."""
    return [e._replace(round=e.round + e.part.base[rank]) if rank in e.part.base else e for e in entries]


def _sum_into(out: Tensor, grads: list[Tensor]) -> Tensor:
    """``out = sum(grads)`` without temporaries."""
    if len(grads) == 1:
        return out.copy_(grads[0])
    torch.add(grads[0], grads[1], out=out)
    for g in grads[2:]:
        out.add_(g)
    return out
