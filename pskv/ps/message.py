"""pskv's wire format: a fixed binary header, optional JSON metadata, raw tensor frames.

A message is a list of frames (one zmq multipart message)::

    frame 0   header: struct HEADER (60 bytes, little-endian)
    frame 1   JSON metadata, present iff header.meta_len > 0 (UTF-8, at most MAX_META bytes)
    frame 2.. payload: raw bytes of contiguous tensors (dtype and shape are known from the key
              or given in the metadata), never pickled

Header fields: magic ``b"PSKV"``, version, message type, flags, sender node id, request id,
key, part, three general integers ``a``, ``b``, ``c`` whose meaning depends on the type (listed
with :class:`Type`), and the metadata length. Decoding checks every field and raises
:class:`~pskv.errors.ProtocolError` on anything malformed; nothing received is ever evaluated.

This module imports nothing else from pskv but the errors, and imports torch only inside the
tensor helpers, so the scheduler (which moves control messages only) does not load torch.
"""

from __future__ import annotations

import array
import enum
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from ..errors import ProtocolError

if TYPE_CHECKING:
    import torch

MAGIC = b"PSKV"
VERSION = 1
MAX_META = 1 << 20
HEADER = struct.Struct("<4sBBHqQQIqqqI")

Buffer = Union[bytes, bytearray, memoryview, Any]  # Any: zmq.Frame, numpy arrays


class Type(enum.IntEnum):
    """Message types. ``a``/``b``/``c`` are the header's general integers."""

    # node <-> scheduler
    REGISTER = 1  # meta: role, host, port, pid, hostname, worker_id/server_id (optional)
    NODES = 2  # meta: the node table; a: this node's rank, b: this node's id
    BARRIER = 3  # meta: group ("worker", "server", "all"); a: barrier sequence number
    BARRIER_DONE = 4  # a: barrier sequence number
    HEARTBEAT = 5
    HEARTBEAT_ACK = 6
    FINALIZE = 7  # a worker is done (closed its store)
    WORKER_LEFT = 8  # a: the rank of a worker that finished
    NODE_FAILED = 9  # meta: role, rank, host, pid, reason
    SHUTDOWN = 10
    # worker <-> server
    INIT = 20  # meta: dtype, shape, numel, name, mode, row_sparse; frame: the value (rank 0 only)
    PUSH = 21  # frames: dense part, or (rows, values) with SPARSE, or codec payloads with COMPRESSED
    PULL = 22  # a: how many pushes of this part the worker has issued (the round it must see)
    ROW_PULL = 23  # frame: int64 row ids local to the part
    SET_OPTIMIZER = 24  # meta: optimizer description, keep_states
    GET_STATES = 25
    SET_STATES = 26  # meta: per-part state layout; frames: state tensors
    SHM_PROBE = 27  # meta: pid, fd, token of the worker's arena; the reply: the server's
    HELLO = 28  # a worker's receiving connection introduces itself (answered OK)
    # replies (req_id matches the request)
    OK = 40
    DATA = 41  # frames: tensors
    ERROR = 42  # meta: kind (an exception class name from pskv.errors), message


class Flag(enum.IntFlag):
    NONE = 0
    SPARSE = 1  # payload is (row ids, row values)
    COMPRESSED = 2  # payload is one codec frame per device value; meta holds the codec
    SHM = 4  # payload is in shared memory: a = the owner's fd, b = offset, c = bytes (pid: node table)
    BATCH = 8  # many parts in one message: the first payload frame is an index (see pack_index)


_KNOWN_FLAGS = int(Flag.SPARSE | Flag.COMPRESSED | Flag.SHM | Flag.BATCH)


@dataclass
class Message:
    """One decoded message. ``frames`` are the payload frames only (header and meta excluded)."""

    type: Type
    req_id: int = 0
    key: int = 0
    part: int = 0
    a: int = 0
    b: int = 0
    c: int = 0
    flags: Flag = Flag.NONE
    sender: int = -1
    meta: dict[str, Any] | None = None
    frames: list[Buffer] = field(default_factory=list)

    def reply(self, type: Type, **kw: Any) -> Message:
        """A reply to this message (same request id, key and part)."""
        return Message(type, req_id=self.req_id, key=self.key, part=self.part, **kw)

    def __str__(self) -> str:
        return f"{self.type.name}(req={self.req_id}, key={self.key}, part={self.part}, frames={len(self.frames)})"


def encode(msg: Message) -> list[Buffer]:
    """The frames to send for ``msg``."""
    meta = b"" if msg.meta is None else json.dumps(msg.meta, separators=(",", ":"), allow_nan=False).encode()
    if len(meta) > MAX_META:
        raise ProtocolError(f"metadata of {msg} is {len(meta)} bytes; at most {MAX_META}")
    head = HEADER.pack(
        MAGIC, VERSION, int(msg.type), int(msg.flags), msg.sender, msg.req_id, msg.key, msg.part, msg.a, msg.b, msg.c, len(meta)
    )
    return [head, meta, *msg.frames] if meta else [head, *msg.frames]


def _buf(frame: Buffer) -> memoryview:
    if hasattr(frame, "buffer"):  # zmq.Frame
        return memoryview(frame.buffer)
    return memoryview(frame)


def decode(frames: Sequence[Buffer]) -> Message:
    """Parse frames received from the network; :class:`ProtocolError` if malformed."""
    if not frames:
        raise ProtocolError("empty message")
    head = _buf(frames[0])
    if head.nbytes != HEADER.size:
        raise ProtocolError(f"header is {head.nbytes} bytes, expected {HEADER.size}")
    magic, version, mtype, flags, sender, req_id, key, part, a, b, c, meta_len = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"wire version {version}, this pskv speaks {VERSION}")
    try:
        kind = Type(mtype)
    except ValueError:
        raise ProtocolError(f"unknown message type {mtype}") from None
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown flags {flags}")
    flag = Flag(flags)
    meta = None
    rest = list(frames[1:])
    if meta_len:
        if meta_len > MAX_META or not rest:
            raise ProtocolError(f"metadata length {meta_len} without a metadata frame or over {MAX_META}")
        raw = _buf(rest.pop(0))
        if raw.nbytes != meta_len:
            raise ProtocolError(f"metadata frame is {raw.nbytes} bytes, header says {meta_len}")
        try:
            meta = json.loads(raw.tobytes())
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"metadata is not JSON: {exc}") from None
        if not isinstance(meta, dict):
            raise ProtocolError("metadata must be a JSON object")
    return Message(kind, req_id, key, part, a, b, c, flag, sender, meta, rest)


def pack_index(rows: Sequence[Sequence[int]], cols: int) -> bytes:
    """An index frame: ``rows`` of ``cols`` int64 each (a batched message's table of parts)."""
    flat = array.array("q")
    for row in rows:
        if len(row) != cols:
            raise ValueError(f"index rows have {cols} columns, got {len(row)}")
        flat.extend(row)
    return flat.tobytes()


def unpack_index(frame: Buffer, cols: int) -> list[tuple[int, ...]]:
    """The rows of an index frame; :class:`ProtocolError` if it is not ``n x cols`` int64."""
    buf = _buf(frame)
    if buf.nbytes % (8 * cols):
        raise ProtocolError(f"an index frame of {buf.nbytes} bytes is not a table of {cols} int64 columns")
    values = array.array("q")
    values.frombytes(buf.tobytes())
    return [tuple(values[i : i + cols]) for i in range(0, len(values), cols)]


def error_reply(request: Message, exc: BaseException) -> Message:
    """An ERROR reply carrying ``exc``'s class name and text."""
    return request.reply(Type.ERROR, meta={"kind": type(exc).__name__, "message": str(exc)})


# -- tensors <-> frames (torch imported lazily) --------------------------------------------------

DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "complex64",
    "complex128",
)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (one of :data:`DTYPES`)."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ProtocolError(f"dtype {dtype} cannot travel; supported: {', '.join(DTYPES)}")
    return name


def torch_dtype(name: object) -> torch.dtype:
    """The torch dtype named ``name``, for names in :data:`DTYPES` only."""
    import torch

    if not isinstance(name, str) or name not in DTYPES:
        raise ProtocolError(f"unsupported dtype {name!r}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def tensor_frame(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_frame needs a contiguous CPU tensor")
    view: Any = t.reshape(-1).view(_byte_dtype()).numpy()
    return memoryview(view)


def nbytes(frame: Buffer) -> int:
    """The size of a payload frame in bytes."""
    return _buf(frame).nbytes


def frame_tensor(frame: Buffer, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
    """A 1-D tensor over ``frame``'s bytes (no copy); checks it holds exactly ``numel`` elements.

    With ``numel=None`` the frame must hold a whole number of elements.
    """
    import torch

    buf = _buf(frame)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel is None:
        if buf.nbytes % itemsize:
            raise ProtocolError(f"payload of {buf.nbytes} bytes is not a whole number of {dtype} elements")
        numel = buf.nbytes // itemsize
    if buf.nbytes != numel * itemsize:
        raise ProtocolError(f"payload is {buf.nbytes} bytes, expected {numel} x {itemsize}")
    if buf.readonly:
        buf = memoryview(bytearray(buf))
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype)


def _byte_dtype() -> torch.dtype:
    import torch

    return torch.uint8
