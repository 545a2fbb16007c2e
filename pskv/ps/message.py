"""pskv's wire format (docs/DESIGN.md, "A round of dist_sync"). A message is one zmq multipart message::

    frame 0   header: magic b"PSKV", version, type, request id, metadata length (HEADER, 20 bytes)
    frame 1   JSON metadata, iff its length is not 0 (at most MAX_META bytes)
    frame 2.. payload: a table of int64 rows (:class:`Layout`), then raw tensor bytes, never pickled

Decoding checks every field (:class:`~pskv.errors.ProtocolError`); nothing received is evaluated.
Torch is imported only inside the tensor helpers: the scheduler does not load it.
"""

from __future__ import annotations

import array
import enum
import json
import struct
from collections import namedtuple
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

from ..errors import ProtocolError

if TYPE_CHECKING:
    import torch

MAGIC = b"PSKV"
VERSION = 5  # 3: PUSH rows carry a rescale; 4: optimizer states list their parts in a JSON frame; 5: so does NODES its nodes
MAX_META = 1 << 20
HEADER = struct.Struct("<4sBBxxqI")

Buffer = Union[bytes, bytearray, memoryview, Any]  # Any: zmq.Frame, numpy arrays


class Type(enum.IntEnum):
    """Message types, with what their metadata (meta) and payload carry."""

    # node <-> scheduler
    REGISTER = 1  # meta: role, endpoint, host, hostname, pid, shm_host, id (the rank asked for, or null)
    NODES = 2  # meta: rank (this node's), heartbeat, rejoined; payload: a JSON frame of servers, workers (the node table)
    BARRIER = 3  # meta: group ("worker", "server", "all"), value (optional, JSON)
    HEARTBEAT = 5
    HEARTBEAT_ACK = 6
    FINALIZE = 7  # a worker is done (closed its store)
    WORKER_LEFT = 8  # meta: rank of a worker that finished
    NODE_FAILED = 9  # meta: role, rank, host, pid, reason
    SHUTDOWN = 10
    SERVER_LOST = 11  # meta: rank of a server whose parts its backup (the next server) now serves
    WORKER_BACK = 12  # meta: ranks of workers in lost ones' places, counted in from now on; answered OK
    # worker <-> server
    HELLO = 19  # meta: rank, answers (true on the connection the worker reads answers from)
    INIT = 20  # meta: mode, parts [[key, part, dtype, numel, row_numel, row_sparse, name]]; payload: values (rank 0)
    PUSH = 21  # payload: PUSH rows, then the frames the rows announce; meta: codec (compressed rows)
    PULL = 22  # payload: PULL rows, then a row-id frame per row that asks for rows
    SET_OPTIMIZER = 24  # meta: optimizer (description), keep_states
    GET_STATES = 25
    SET_STATES = 26  # meta: optimizer, num_update; payload: a JSON frame of parts [{key, part, step, names}], then state tensors
    SHM_PROBE = 27  # meta: pid, fd, token of the worker's arena; the reply: the server's
    # replies (req_id matches the request)
    OK = 40  # payload of an answer to INIT/PUSH: ANSWER rows (the entries answered)
    DATA = 41  # payload: ANSWER rows, then the frames they announce (PULL); or as SET_STATES's (GET_STATES)
    ERROR = 42  # meta: kind (an exception class name from pskv.errors), message


class Layout:
    """A table of int64 rows with named columns: the index frame of a batched message."""

    def __init__(self, name: str, *columns: str):
        self.name, self.width = name, len(columns)
        self._make: Callable[[Iterable[int]], Any] = namedtuple(name, columns)._make  # type: ignore[attr-defined]

    def pack(self, rows: Sequence[Sequence[int]]) -> bytes:
        flat = array.array("q")
        for row in rows:
            if len(row) != self.width:
                raise ValueError(f"a {self.name} row has {self.width} columns, got {len(row)}")
            flat.extend(row)
        return flat.tobytes()

    def unpack(self, frame: Buffer) -> Iterator[Any]:
        """The rows of ``frame``, one at a time (thousands of them alive at once would make Python's GC walk
        them); :class:`ProtocolError` at once unless it is ``n x width`` int64."""
        buf = _buf(frame)
        if buf.nbytes % (8 * self.width):
            raise ProtocolError(f"a {self.name} table of {buf.nbytes} bytes is not rows of {self.width} int64")
        values = array.array("q", buf.tobytes())
        return (self._make(values[i : i + self.width]) for i in range(0, len(values), self.width))


class PushKind(enum.IntEnum):
    """How a pushed part's gradient travels (the ``kind`` column of a PUSH row)."""

    DENSE = 0  # one frame of the part's bytes, or none when the bytes are in shared memory (fd >= 0)
    SPARSE = 1  # two frames: int64 row ids local to the part, and those rows' values
    COMPRESSED = 2  # ``frames`` codec payloads (one per device value), codec named in the meta


#: a pushed part: ``frames`` payload frames follow in row order; ``fd`` >= 0: the dense bytes are
#: at ``offset`` in the sender's shared-memory arena ``fd`` instead; ``held`` 1: the round's
#: update waits for the rescale a pull brings; ``reply`` 1: answered with the part's value once
#: its round is complete (docs/DESIGN.md, "The exchange as a pipeline")
PUSH = Layout("PushRow", "key", "part", "round", "kind", "frames", "fd", "offset", "held", "reply", "rescale")
#: a pulled part, wanted as of round ``round`` (the pushes of it this worker has sent);
#: ``shm`` 1: answer with a shared-memory slot if there is one; ``rows`` 1: only the rows whose
#: ids (int64, local to the part) come in the next row-id frame, 2: ``rows x (row_numel + 1)``, the last
#: column 1 for the rows a row-sparse output holds (rounds.Part.present); ``rescale``: 0, or the bits of a
#: float64 that scales the held round's gradient (:func:`float_bits`); ``mirror`` 1: to the part's
#: backup, which takes the rescale and acknowledges (docs/DESIGN.md, "A lost server")
PULL = Layout("PullRow", "key", "part", "round", "shm", "rows", "rescale", "mirror")
#: an answered entry of a batched request: ``entry`` is its row; ``fd`` >= 0: the value is at
#: ``offset`` (``nbytes``) of the server's arena ``fd``; -1: in the next payload frame (DATA only)
ANSWER = Layout("AnswerRow", "entry", "fd", "offset", "nbytes")


def float_bits(x: float) -> int:
    """A float64 as the int64 of the same bits, for a table column (0.0 is 0)."""
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def bits_float(i: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", i))[0])


@dataclass
class Message:
    """One decoded message. ``frames`` are the payload frames only (header and meta excluded)."""

    type: Type
    req_id: int = 0
    meta: dict[str, Any] | None = None
    frames: list[Buffer] = field(default_factory=list)

    def reply(self, type: Type, meta: dict[str, Any] | None = None, frames: list[Buffer] | None = None) -> Message:
        return Message(type, self.req_id, meta, frames or [])

    def __str__(self) -> str:
        return f"{self.type.name}(req={self.req_id}, frames={len(self.frames)})"


def encode(msg: Message) -> list[Buffer]:
    meta = b"" if msg.meta is None else json.dumps(msg.meta, separators=(",", ":"), allow_nan=False).encode()
    if len(meta) > MAX_META:
        raise ProtocolError(f"metadata of {msg} is {len(meta)} bytes; at most {MAX_META}")
    head = HEADER.pack(MAGIC, VERSION, int(msg.type), msg.req_id, len(meta))
    return [head, meta, *msg.frames] if meta else [head, *msg.frames]


def _buf(frame: Buffer) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame)  # zmq.Frame, or a buffer


def decode(frames: Sequence[Buffer]) -> Message:
    """Parse frames received from the network; :class:`ProtocolError` if malformed."""
    if not frames:
        raise ProtocolError("empty message")
    head = _buf(frames[0])
    if head.nbytes != HEADER.size:
        if head[:8].tobytes() == b"PSKVAUTH":  # (pskv.ps.van's proof, to a process without the secret)
            raise ProtocolError("a proof of PSKV_SECRET reached a process that has no secret: every process of a job needs the same one")
        raise ProtocolError(f"header is {head.nbytes} bytes, expected {HEADER.size}")
    magic, version, mtype, req_id, meta_len = HEADER.unpack(head)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"wire version {version}, this pskv speaks {VERSION}")
    try:
        kind = Type(mtype)
    except ValueError:
        raise ProtocolError(f"unknown message type {mtype}") from None
    meta, rest = None, list(frames[1:])
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
    return Message(kind, req_id, meta, rest)


def json_frame(value: Any) -> bytes:
    """A payload frame of JSON: a table with an entry per part (optimizer states), which may be far over ``MAX_META``."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def frame_json(frame: Buffer) -> Any:
    try:
        return json.loads(_buf(frame).tobytes())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"a JSON frame that is not JSON: {exc}") from None


def error_reply(request: Message | None, exc: BaseException) -> Message:
    """An ERROR reply to ``request`` (None: to frames that did not decode): ``exc``'s class name and text."""
    return Message(Type.ERROR, request.req_id if request else 0, {"kind": type(exc).__name__, "message": str(exc)})


DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool", "complex64", "complex128")


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ProtocolError(f"dtype {dtype} cannot travel; supported: {', '.join(DTYPES)}")
    return name


def torch_dtype(name: object) -> torch.dtype:
    import torch
    if not isinstance(name, str) or name not in DTYPES:
        raise ProtocolError(f"unsupported dtype {name!r}")
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def tensor_frame(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    import torch
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_frame needs a contiguous CPU tensor")
    view: Any = t.reshape(-1).view(torch.uint8).numpy()
    return memoryview(view)


def frame_tensor(frame: Buffer, dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
    """A 1-D tensor over ``frame``'s bytes of exactly ``numel`` elements (None: any number); a copy only where the
    frame does not start at a multiple of the item size (zmq's small frames may start at any even address)."""
    import torch
    buf = _buf(frame)
    itemsize = dtype.itemsize
    if numel is None:
        if buf.nbytes % itemsize:
            raise ProtocolError(f"payload of {buf.nbytes} bytes is not a whole number of {dtype} elements")
        numel = buf.nbytes // itemsize
    if buf.nbytes != numel * itemsize:
        raise ProtocolError(f"payload is {buf.nbytes} bytes, expected {numel} x {itemsize}")
    if buf.readonly:
        buf = memoryview(bytearray(buf))
    t = torch.frombuffer(buf, dtype=dtype) if numel else torch.empty(0, dtype=dtype)  # (no kernel has read it yet)
    return torch.frombuffer(buf, dtype=torch.uint8).clone().view(dtype) if t.data_ptr() % itemsize else t  # (complex128 kernels crash on unaligned memory)
