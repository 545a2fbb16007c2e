"""The transport: a :class:`Van` moves messages between this node and its peers, over zmq.

A node listens on one endpoint (a ROUTER) and connects to its peers (a DEALER each); a peer is
named by the name given to :meth:`Van.connect`, or ``"client:<hex>"`` for a connection that
reached us. Payloads are sent without copying; ``inproc://`` endpoints run a job in one process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Optional, Union

import zmq

from ..errors import ClusterError, ProtocolError
from .message import Message, decode, encode

Received = tuple[str, Union[Message, ProtocolError]]


class PeerUnreachable(ClusterError):
    """A message could not even be queued for a peer (it has no live connection)."""


class Van:
    """Moves :class:`~pskv.ps.message.Message`\\s over zmq sockets."""

    MAX_BATCH = 256  # messages taken from one socket per recv, so no peer starves the others

    def __init__(self) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router: Optional[zmq.Socket[bytes]] = None
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._names: dict[zmq.Socket[bytes], str] = {}
        self._poller = zmq.Poller()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self.closed = False

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        return sock

    def listen(self, endpoint: str) -> str:
        """Accept clients on ``endpoint`` (``tcp://host:0`` picks a free port); the bound endpoint."""
        if self._router is not None:
            raise RuntimeError("this van already listens")
        sock = self._socket(zmq.ROUTER)
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            endpoint = endpoint[:-2] + ":*"
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise OSError(f"cannot listen on {endpoint}: {exc}") from exc
        self._router = sock
        self._poller.register(sock, zmq.POLLIN)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, peer: str, endpoint: str, receive: bool = True) -> None:
        """Open a connection named ``peer`` to ``endpoint``; ``receive=False``: only sent on
        (by one thread at a time, not necessarily the van's owner)."""
        if peer in self._dealers:
            raise RuntimeError(f"already connected to {peer}")
        sock = self._socket(zmq.DEALER)
        sock.connect(endpoint)
        self._dealers[peer] = sock
        self._names[sock] = peer
        if receive:
            self._poller.register(sock, zmq.POLLIN)

    def send(self, peer: str, msg: Message, track: bool = False) -> Optional[Callable[[float], bool]]:
        """Queue ``msg`` for ``peer`` and return (payload buffers must stay unchanged until sent);
        :class:`PeerUnreachable` if it cannot take it. With ``track``, returns ``wait(timeout) ->
        bool``, true once the payload buffers may be reused."""
        frames = encode(msg)
        try:
            if peer.startswith("client:"):
                if self._router is None:
                    raise RuntimeError("no listening socket to reply on")
                frames = [bytes.fromhex(peer[7:]), *frames]
                tracker = self._router.send_multipart(frames, zmq.NOBLOCK, copy=False, track=track)
            else:
                tracker = self._dealers[peer].send_multipart(frames, zmq.NOBLOCK, copy=False, track=track)
        except (zmq.Again, zmq.ZMQError) as exc:
            raise PeerUnreachable(f"{peer} has no live connection; {msg.type.name} was not sent ({exc})") from None
        if not track or tracker is None:
            return None
        done = tracker

        def wait(timeout: float) -> bool:
            with contextlib.suppress(zmq.NotDone):
                done.wait(timeout)
            return done.done

        return wait

    def recv(self, timeout: float) -> list[Received]:
        """Messages that arrived, waiting up to ``timeout`` s for the first (or a wake-up); one
        that does not decode comes as a :class:`ProtocolError`, so its sender can be answered."""
        out: list[Received] = []
        for sock, _ in self._poller.poll(max(0, int(timeout * 1000))):
            if isinstance(sock, int):
                with contextlib.suppress(BlockingIOError):
                    while os.read(sock, 4096):
                        pass
                continue
            for _ in range(self.MAX_BATCH):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if sock is self._router:
                    peer = "client:" + bytes(frames[0].buffer).hex()
                    frames = frames[1:]
                else:
                    peer = self._names[sock]
                try:
                    out.append((peer, decode(frames)))
                except ProtocolError as exc:
                    out.append((peer, exc))
        return out

    def wake(self) -> None:
        """Make a blocked :meth:`recv` return now; safe from any thread."""
        with contextlib.suppress(OSError):  # a wake-up is already pending, or the van is closed (fd -1)
            os.write(self._wake_w, b"!")

    def close(self, linger: float = 1.0) -> None:
        """Close every connection, trying for ``linger`` seconds to deliver what is queued."""
        if self.closed:
            return
        self.closed = True
        for sock in [*self._dealers.values(), *([self._router] if self._router is not None else [])]:
            sock.setsockopt(zmq.LINGER, int(linger * 1000))
            sock.close()
        self._dealers.clear()
        fds = (self._wake_r, self._wake_w)
        self._wake_r = self._wake_w = -1
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
