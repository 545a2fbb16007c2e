"""The transport: a :class:`Van` moves messages between this node and its peers over zmq. A node listens
on one endpoint (a ROUTER) and connects to its peers (a DEALER each); a peer is named as given to
:meth:`Van.connect`, or ``"client:<hex>"`` for a connection that reached us. Payloads are sent without
copying; ``inproc://`` endpoints run a job in one process. A TCP connection that closes comes out of
:meth:`Van.recv` as a :class:`PeerGone` at once, so nobody waits for a heartbeat deadline to learn it. With a
job secret, a connection first proves it holds it, or is not heard (docs/DESIGN.md, "Who may talk to a job")."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import struct
import sys
import time
from collections.abc import Callable
from typing import Optional, Union

import zmq
from zmq.utils.monitor import recv_monitor_message

from .. import config
from ..errors import ClusterError, ProtocolError
from .message import Message, Type, _buf, decode, encode, error_reply


class PeerUnreachable(ClusterError):
    """A message could not even be queued for a peer (it has no live connection)."""


class PeerGone(ClusterError):
    """A watched connection closed, or a watched pipe (the launcher's lifeline) reached its end."""


Received = tuple[str, Union[Message, ProtocolError, PeerGone]]
#: a connection's first frame when the job has a secret: tag, role, rank, nonce, HMAC-SHA256 of the rest
AUTH = struct.Struct("<8sBq16s32s")
ROLES = ("scheduler", "server", "worker")
_LOGGED = 100  # addresses whose dropped messages are logged (once each)


def _proof(secret: bytes, role: int, rank: int, nonce: bytes, endpoint: str) -> bytes:
    """The MAC of a connection's proof, bound to the listener's port (or inproc name)."""
    bound = f"{role}|{rank}|{endpoint.rsplit(':', 1)[-1]}|".encode()
    return hmac.new(secret, bound + nonce, hashlib.sha256).digest()


def _curve_keys(secret: bytes, name: bytes) -> tuple[bytes, bytes]:
    """A CURVE key pair (public, secret; Z85) derived from the job's secret (``PSKV_ENCRYPT``)."""
    from zmq.utils import z85
    private = z85.encode(hmac.new(secret, b"pskv-curve-" + name, hashlib.sha256).digest())
    return zmq.curve_public(private), private


class Van:
    MAX_BATCH = 256  # messages taken from one socket per recv, so no peer starves the others

    def __init__(self, role: str) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router: Optional[zmq.Socket[bytes]] = None
        self._dealers: dict[str, zmq.Socket[bytes]] = {}
        self._names: dict[zmq.Socket[bytes], str] = {}  # dealers -> peer names
        self._monitors: dict[zmq.Socket[bytes], tuple[zmq.Socket[bytes], str]] = {}  # monitor -> its socket, peer name (TCP only)
        self._fds: dict[bytes, int] = {}  # a connection that reached us -> its file descriptor (for its end)
        self._pipes: dict[int, str] = {}  # watched pipes -> names
        self.polled = 0.0  # when recv last looked at every connection: silence is judged against it
        self._poller = zmq.Poller()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK)  # written to by :meth:`wake`
        self._poller.register(self._wake, zmq.POLLIN)
        self.closed = False
        self.secret, self.encrypt = config.secret(), config.encrypt()
        if self.encrypt and self.secret is None:
            raise ClusterError("PSKV_ENCRYPT=1 needs the job's secret: PSKV_SECRET or PSKV_SECRET_FILE")
        self.identity = (role, -1)  # (role, rank) this node proves on the connections it opens
        self.max_frame = 0  # frames over this many bytes are refused (0: any size)
        self._endpoint = ""
        self._peers: dict[bytes, tuple[str, int]] = {}  # proven connections -> (role, rank)
        self._nonces: set[bytes] = set()
        self._logged: set[str] = set()

    def _socket(self, kind: int, endpoint: str) -> zmq.Socket[bytes]:
        sock = self._ctx.socket(kind)
        for option in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            sock.setsockopt(option, 0)
        sock.setsockopt(zmq.IPV6, endpoint.startswith("tcp://["))  # (DMLC_PS_ROOT_URI=::1; zmq refused it: "No such device")
        return sock

    def listen(self, endpoint: str, max_frame: int = 0) -> str:
        """Accept clients on ``endpoint`` (``tcp://host:0`` picks a free port); the bound endpoint.
        A client that sends a frame over ``max_frame`` bytes (0: no limit) is disconnected."""
        sock = self._socket(zmq.ROUTER, endpoint)
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame or -1)
        if self.encrypt:
            assert self.secret is not None
            sock.curve_server, sock.curve_secretkey = True, _curve_keys(self.secret, b"server")[1]
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            endpoint = endpoint[:-2] + ":*"
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            sock.close()
            raise ClusterError(f"cannot listen on {endpoint}: {exc}") from None  # (a port in use: one line, not a traceback)
        self._router = sock
        self._poller.register(sock, zmq.POLLIN)
        self._watch(sock, "", endpoint)
        self._endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if self.secret is None and not endpoint.startswith(("inproc://", "tcp://127.", "tcp://localhost", "tcp://[::1]")):
            self._log(f"listening on {self._endpoint} without a job secret: anyone who reaches it can take part (set PSKV_SECRET, or start with `pskv launch`)")
        return self._endpoint

    def _watch(self, sock: zmq.Socket[bytes], peer: str, endpoint: str) -> None:
        """Report ``sock``'s TCP connections that close (inproc ones end only with the process)."""
        if endpoint.startswith("tcp://"):
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitors[monitor] = (sock, peer)
            self._poller.register(monitor, zmq.POLLIN)

    def watch_pipe(self, fd: int, name: str) -> None:
        """Report the end of pipe ``fd`` (a lifeline whose writer is process ``name``) as ``PeerGone``."""
        self._pipes[fd] = name
        self._poller.register(fd, zmq.POLLIN)

    def connect(self, peer: str, endpoint: str, receive: bool = True, watch: bool = False, sndbuf: int = 0) -> None:
        """Open a connection named ``peer`` to ``endpoint``; ``receive=False``: only sent on
        (by one thread at a time, not necessarily the van's owner); ``watch``: report its end;
        ``sndbuf``: the kernel's send buffer in bytes (0: the kernel sizes it)."""
        sock = self._socket(zmq.DEALER, endpoint)
        sock.setsockopt(zmq.ROUTING_ID, b"\x01" + os.urandom(15))  # unguessable: a proof holds for this connection only
        if sndbuf:
            sock.setsockopt(zmq.SNDBUF, sndbuf)
        if self.encrypt:
            assert self.secret is not None
            sock.curve_serverkey = _curve_keys(self.secret, b"server")[0]
            sock.curve_publickey, sock.curve_secretkey = _curve_keys(self.secret, b"client")
        sock.connect(endpoint)
        if self.secret is not None:
            role, rank, nonce = ROLES.index(self.identity[0]), self.identity[1], os.urandom(16)
            sock.send(AUTH.pack(b"PSKVAUTH", role, rank, nonce, _proof(self.secret, role, rank, nonce, endpoint)))
        self._dealers[peer] = sock
        self._names[sock] = peer
        if receive:
            self._poller.register(sock, zmq.POLLIN)
        if watch:
            self._watch(sock, peer, endpoint)

    def send(self, peer: str, msg: Message, track: bool = False) -> Optional[Callable[[float], bool]]:
        """Queue ``msg`` for ``peer`` (its payload buffers must stay unchanged until sent; with ``track``, the
        ``wait(timeout)`` returned is true once they may be reused); :class:`PeerUnreachable` if it cannot."""
        frames = encode(msg)
        client = peer.startswith("client:")  # (only a listener has such peers)
        over = [n for n in (_buf(f).nbytes for f in frames) if n > self.max_frame] if self.max_frame and not client else []
        if over:
            raise ProtocolError(f"{msg.type.name} to {peer.split('/')[0]} has a frame of {over[0]} bytes; servers take at most "
                                f"{self.max_frame} (PSKV_MAX_MESSAGE_BYTES; set it the same for every node of the job)")
        sock = self._router if client else self._dealers[peer]
        assert sock is not None
        try:
            tracker = sock.send_multipart([bytes.fromhex(peer[7:]), *frames] if client else frames, zmq.NOBLOCK, copy=False, track=track)
        except (zmq.Again, zmq.ZMQError) as exc:
            raise PeerUnreachable(f"{peer} has no live connection; {msg.type.name} was not sent ({exc})") from None
        if not track or tracker is None:
            return None
        def wait(timeout: float) -> bool:
            with contextlib.suppress(zmq.NotDone):
                tracker.wait(timeout)
            return tracker.done
        return wait

    def post(self, peer: str, msg: Message) -> None:
        """:meth:`send`, logging a failure instead of raising it (a peer that vanished must not take a server
        or the scheduler down); a message too big to send goes as an ERROR saying so (its peer waited for it)."""
        try:
            self.send(peer, msg)
        except Exception as exc:
            self._log(f"could not send {msg.type.name} to {peer}: {exc}")
            if isinstance(exc, ProtocolError) and msg.type != Type.ERROR:
                self.post(peer, error_reply(msg, exc))

    def recv(self, timeout: float) -> list[Received]:
        """Messages that arrived, waiting up to ``timeout`` s for the first (or a wake-up); one
        that does not decode comes as a :class:`ProtocolError`, so its sender can be answered."""
        out: list[Received] = []
        self.polled = time.monotonic()
        for sock, _ in self._poller.poll(max(0, int(timeout * 1000))):
            if isinstance(sock, int):
                if sock == self._wake:
                    os.eventfd_read(sock)  # (takes every wake-up so far)
                elif not os.read(sock, 4096):  # a watched pipe
                    self._poller.unregister(sock)
                    out.append((self._pipes.pop(sock), PeerGone("its end of the lifeline closed")))
                continue
            if sock in self._monitors:  # connections that closed: what they sent first comes first
                gone = self._closed(sock)
                out.extend(self._read(self._monitors[sock][0]) if gone else [])  # (a poll may see the end only)
                out.extend(gone)
            else:
                out.extend(self._read(sock))
        return out

    def _read(self, sock: zmq.Socket[bytes]) -> list[Received]:
        """What arrived on ``sock`` (up to ``MAX_BATCH`` messages), without waiting."""
        out: list[Received] = []
        for _ in range(self.MAX_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            if sock is self._router:
                route = bytes(frames[0].buffer)
                if route not in self._fds and self._monitors:
                    with contextlib.suppress(zmq.ZMQError):  # (EINVAL for some frames: the next one tells)
                        fd = frames[1].get(zmq.SRCFD)  # (a connection that had it before is gone)
                        self._fds = {r: f for r, f in self._fds.items() if f != fd} | {route: fd}
                if self.secret is not None and route not in self._peers:
                    self._admit(route, frames[1:])
                    continue
                peer = "client:" + route.hex()
                frames = frames[1:]
            else:
                peer = self._names[sock]
            try:
                out.append((peer, decode(frames)))
            except ProtocolError as exc:
                out.append((peer, exc))
        return out

    def _closed(self, monitor: zmq.Socket[bytes]) -> list[Received]:
        out: list[Received] = []
        while monitor.poll(0):
            fd = recv_monitor_message(monitor)["value"]
            peer = self._monitors[monitor][1]
            if not peer:  # the listener's: which connection had that descriptor
                # (a suspicion only: the descriptor may have been reused by a connection that has
                # not sent yet, so a peer that goes on sending is alive; the next message tells its fd)
                route = next((r for r, f in self._fds.items() if f == fd), None)
                if route is not None:  # (its descriptor may be reused: forget it, a stranger's too)
                    del self._fds[route]
                if route is None or (self.secret is not None and route not in self._peers):
                    continue  # one that sent nothing, or a stranger's
                peer = "client:" + route.hex()
            out.append((peer, PeerGone("its connection closed: the process exited or was killed")))
        return out

    def _admit(self, route: bytes, frames: list[zmq.Frame]) -> None:
        """Take a connection's proof, or drop what it sent: no answer, one log line per address."""
        if len(frames) == 1 and len(frames[0]) == AUTH.size:
            tag, role, rank, nonce, mac = AUTH.unpack(frames[0].buffer)
            good = tag == b"PSKVAUTH" and role < len(ROLES) and nonce not in self._nonces
            assert self.secret is not None
            if good and hmac.compare_digest(mac, _proof(self.secret, role, rank, nonce, self._endpoint)):
                self._nonces.add(nonce)
                self._peers[route] = (ROLES[role], rank)
                return
        try:
            address = str(frames[0].get("Peer-Address"))
        except zmq.ZMQError:  # inproc
            address = "inproc"
        if address not in self._logged and len(self._logged) < _LOGGED:
            self._logged.add(address)
            self._log(f"dropping what {address} sends: its connection did not prove it holds the job's secret")

    def who(self, peer: str) -> Optional[tuple[str, int]]:
        """The (role, rank) a connection that reached us proved (None without a job secret)."""
        return self._peers.get(bytes.fromhex(peer[7:])) if peer.startswith("client:") else None

    def _log(self, text: str) -> None:
        role, rank = self.identity
        print(f"pskv {role}{f' {rank}' if rank >= 0 else ''}: {text}", file=sys.stderr, flush=True)

    def wake(self) -> None:
        """Make a blocked :meth:`recv` return now; safe from any thread."""
        with contextlib.suppress(OSError, ValueError):  # the van is closed (fd -1: a ValueError)
            os.eventfd_write(self._wake, 1)

    def close(self, linger: float = 1.0) -> None:
        """Close every connection, trying for ``linger`` seconds to deliver what is queued."""
        if self.closed:
            return
        self.closed = True
        for monitor, (sock, _) in self._monitors.items():
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)
        for sock in [*self._dealers.values(), *([self._router] if self._router is not None else [])]:
            sock.close(linger=int(linger * 1000))
        self._dealers.clear()
        wake, self._wake = self._wake, -1
        os.close(wake)
