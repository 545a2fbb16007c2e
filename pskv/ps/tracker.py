"""What a worker waits for: requests sent and not answered yet, and the calls (:class:`Handle`) they
serve (a data request's rows are answered one by one). A push that fails makes the next call on the
store fail, and any wait in progress too: the round it waits for may never come."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import torch

from ..errors import ClusterError, DeadlineExceeded, PSKVError, deadline, from_reply
from .message import ANSWER, Message, Type, frame_tensor

OnReply = Callable[[Message], None]
BATCHED = (Type.INIT, Type.PUSH, Type.PULL)  # answered row by row (ANSWER tables)
Sink = Union[Any, Callable[[Any], None]]  # a tensor to copy a pulled part into, or a function of it


def _raise(exc: BaseException) -> None:
    raise type(exc)(str(exc)) if isinstance(exc, PSKVError) else exc


class Handle:
    """A call in flight (``push``/``pull``/``pushpull`` with ``wait=False``): :meth:`wait` blocks until every
    part of it is done and raises its error; :meth:`done` says whether it is. Thread-safe.
    ``h = kv.pull(key, out, wait=False); ...; h.wait()``: then ``out`` holds the value."""

    __slots__ = ("_done", "_finish", "_flush", "_left", "_tracker", "copies", "error", "sent", "staged")  # (thousands may be in flight)

    def __init__(self, tracker: Optional[Tracker] = None, finish: Optional[Callable[[], None]] = None, flush: Optional[Callable[[], Any]] = None):
        self._tracker = tracker
        self._finish = [finish] if finish is not None else ()  # runs once, in a caller's thread, when a wait succeeds
        self._flush = flush  # sends what is still queued, so that waiting for it makes sense
        self._left = 0
        self._done = tracker is None
        self.error: Optional[BaseException] = None
        # (empty tuples until used, replaced, not appended to: fewer objects alive per call, for Python's GC to walk)
        self.sent: Sequence[Callable[[float], bool]] = ()  # waits for zmq to be done with this call's pushed bytes
        self.copies: Sequence[tuple[Any, Any]] = ()  # (CUDA event, GPU) of its answers' copies: the caller's stream there waits
        self.staged: Union[list[tuple[Any, Any]], tuple[()]] = ()  # (GPU piece, answer): copied together by the first wait

    @property
    def finished(self) -> bool:
        """True once a wait has succeeded (the answers are where they go, or on their way on a GPU)."""
        return self._done and not self._finish

    def done(self) -> bool:
        """True once every part is done (or the call failed); handles the answers that arrived."""
        if not self._done and self._tracker is not None:
            self._tracker.pump(0.0)
        return self._done

    def wait(self) -> None:
        """Block until done (deadlines as for every call: ``PSKV_TIMEOUT``); raise the call's error."""
        tracker = self._tracker
        if tracker is not None:
            if self._flush is not None and not self._done:
                self._flush()
            until = time.monotonic() + tracker.timeout + 5.0
            while not self._done:
                tracker.pump(0.05)
                if self._done:
                    break
                tracker.raise_failure()  # it may be why this answer is not coming
                if time.monotonic() > until:  # the I/O thread is gone; do not hang
                    raise DeadlineExceeded("no answer within PSKV_TIMEOUT plus a margin, and the I/O thread stopped expiring requests")
        if tracker is not None and (self.error is None or tracker.fatal is None):  # the job's fatal error, or a push
            tracker.raise_failure()  # refused before this call, first: why it failed (a pull after a NaN push)
        if self.error is not None:  # this call's own failure: it says what the call was (a lost node fails both)
            _raise(self.error)
        for copied, device in self.copies:
            copied.wait(torch.cuda.current_stream(device))
        if self._finish:
            try:  # (pop: two threads may wait for one call)
                finish = self._finish.pop()
            except IndexError:
                return
            try:
                finish()
            except BaseException:  # (an interrupt: the next wait copies them)
                self._finish = [finish]
                raise

    def _settle(self, error: Optional[BaseException] = None) -> None:
        self.error = self.error or error
        self._left -= 1
        self._done = self._left <= 0 or error is not None


class Both:
    """The calls of a push and of a pull that rides on its row (``client._fold``): its answer settles both."""

    __slots__ = ("again", "pull", "push", "sent")  # (sent: unread, its push's wait_sent returned before it rode)

    def __init__(self, push: Handle, pull: Handle, again: Callable[[BaseException], bool]):
        self.push, self.pull, self.again, self.sent = push, pull, again, ()

    def _settle(self, error: Optional[BaseException] = None) -> None:
        self.push._settle(error)
        if error is not None and self.again(error):  # the push was refused for its values: the pull goes on its own
            error = None
        self.pull._settle(error)


Entry = tuple[Handle, Optional[Sink], Any]  # the call a row serves (or a Both), where its answer goes, its dtype


class Request:
    """One message in flight; ``entries`` are the calls its rows serve (None once answered)."""

    __slots__ = ("deadline", "entries", "kind", "on_reply", "peer", "remaining", "req_id", "rows", "shared", "what")

    def __init__(self, req_id: int, kind: Type, what: str, peer: str, deadline: float, entries: list[Entry], on_reply: Optional[OnReply]):
        self.req_id, self.kind, self.what, self.peer, self.deadline = req_id, kind, what, peer, deadline
        self.entries: list[Optional[Entry]] = list(entries)
        self.remaining = len(entries)
        self.on_reply = on_reply  # a whole-message request: runs with its answer
        self.shared: Optional[Callable[[Any, Any], Any]] = None  # (ANSWER row, dtype) -> a part in the server's shared memory
        self.rows: Optional[list[tuple[Any, Any]]] = None  # a data request's (row, frames), kept to send again (replicas)


class Tracker:
    """Thread-safe table of open requests. ``pump(timeout)`` receives and handles answers for up
    to ``timeout`` s (a waiting thread does it); ``fatal`` is the job's fatal error, if any."""

    def __init__(self, timeout: float, pump: Callable[[float], None]):
        self.timeout, self.pump = timeout, pump
        self.fatal: Optional[BaseException] = None
        self._lock = threading.Lock()
        self._open: dict[int, Request] = {}
        self._next = 1
        self._failed_pushes: list[BaseException] = []

    def open(self, msg: Message, what: str, peer: str, entries: Iterable[Entry], on_reply: Optional[OnReply] = None) -> Request:
        """A new request for ``msg`` (its ``req_id`` is set) whose rows serve ``entries`` (one: a whole message); their
        calls counted them (``WorkerClient.queue``, ``send``)."""
        with self._lock:
            req = Request(self._next, msg.type, what, peer, time.monotonic() + self.timeout, list(entries), on_reply)
            msg.req_id = self._next
            self._next += 1
            self._open[req.req_id] = req
            return req

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def answer(self, msg: Message) -> None:
        """Handle an answer; unknown request ids are ignored. An ERROR fails the whole request."""
        with self._lock:
            req = self._open.get(msg.req_id)
        if req is None:
            return
        try:
            if msg.type == Type.ERROR:
                raise from_reply(msg.meta, f"{req.what}: ")
            if req.kind not in BATCHED:
                if req.on_reply is not None:
                    req.on_reply(msg)
                self.close(req)
                return
            frames = iter(msg.frames[1:])
            for row in ANSWER.unpack(msg.frames[0]):
                if (entry := req.entries[row.entry]) is None:
                    continue
                handle, sink, dtype = entry
                if sink is not None:  # a function of the part, or a tensor it is copied into
                    src = req.shared(row, dtype) if row.fd >= 0 and req.shared is not None else frame_tensor(next(frames), dtype)
                    if callable(sink):
                        sink(src)
                    else:
                        sink.copy_(src.view(sink.shape))
                req.entries[row.entry] = None
                req.remaining -= 1
                handle._settle()
            if req.remaining <= 0:
                self.close(req)
        except Exception as exc:
            self.close(req, exc)
        except BaseException as exc:  # an interrupt (KeyboardInterrupt) as it was read: the rest is lost, its call fails saying so
            again = {Type.PUSH: ": pull again (its push was applied)", Type.PULL: ": pull again"}.get(req.kind, "")
            self.close(req, ClusterError(f"{req.what}: its answer was cut short by {type(exc).__name__}; what it brought is lost{again}"),
                       refused=False)
            raise

    def close(self, req: Request, exc: Optional[BaseException] = None, refused: bool = True) -> None:
        """Settle the calls ``req`` still serves (failed with ``exc``, if given), unless it is closed; ``refused``: a
        push that fails is one the next call raises too."""
        with self._lock:
            if self._open.pop(req.req_id, None) is None:
                return
            if exc is not None and req.kind == Type.PUSH and refused:
                self._failed_pushes.append(exc)
        for entry in filter(None, req.entries):  # (None: answered)
            entry[0]._settle(exc)

    def take(self, peer: str) -> list[Request]:
        """Remove the open requests to ``peer`` without settling their calls (they are sent elsewhere)."""
        with self._lock:
            return [self._open.pop(r.req_id) for r in list(self._open.values()) if r.peer == peer]

    def fail_all(self, exc: BaseException) -> None:
        """The job failed: ``exc`` becomes ``fatal`` (unless one came first); every request fails."""
        self.fatal = self.fatal or exc
        with self._lock:
            victims = list(self._open.values())
        for r in victims:  # each says what it was doing
            self.close(r, type(exc)(f"{r.what}: {exc}") if isinstance(exc, PSKVError) else exc)

    def expire(self, now: float) -> None:
        with self._lock:
            late = [r for r in self._open.values() if r.deadline < now]
        for r in late:
            self.close(r, deadline(r.what, self.timeout, "PSKV_TIMEOUT plus a margin", self.timeout, f"an answer from {r.peer}"))

    def raise_failure(self) -> None:
        """Raise the job's fatal error, or the error of a push that failed since the last call, if any."""
        if self.fatal is not None:
            _raise(self.fatal)
        with self._lock:
            exc = self._failed_pushes.pop(0) if self._failed_pushes else None
        if exc is not None:
            raise exc
