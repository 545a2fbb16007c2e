"""The wire format: round trips, and every malformed input is a ProtocolError."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from pskv.errors import ProtocolError
from pskv.ps.message import (
    ANSWER,
    HEADER,
    MAGIC,
    PULL,
    PUSH,
    VERSION,
    Message,
    Type,
    bits_float,
    decode,
    dtype_name,
    encode,
    float_bits,
    frame_tensor,
    tensor_frame,
    torch_dtype,
)


def test_roundtrip_with_meta_and_frames() -> None:
    t = torch.arange(6, dtype=torch.float32)
    msg = Message(Type.PUSH, req_id=7, meta={"x": [1, 2]}, frames=[tensor_frame(t)])
    back = decode([bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in encode(msg)])
    assert (back.type, back.req_id, back.meta) == (Type.PUSH, 7, {"x": [1, 2]})
    assert torch.equal(frame_tensor(back.frames[0], torch.float32, 6), t)


def test_no_meta_means_no_meta_frame() -> None:
    frames = encode(Message(Type.PULL, req_id=1))
    assert len(frames) == 1 and len(frames[0]) == HEADER.size
    assert decode(frames).meta is None


def test_layouts_name_their_columns() -> None:
    rows = [(3, 1, 2, 0, 1, -1, 0, 0, 0, 0), (4, 0, 9, 2, 3, 5, 4096, 1, 1, 7)]
    frame = PUSH.pack(rows)
    assert len(list(PUSH.unpack(frame))) == 2 and len(frame) == 2 * 10 * 8
    back = list(PUSH.unpack(frame))
    assert [tuple(r) for r in back] == rows
    assert (back[1].key, back[1].round, back[1].kind, back[1].frames, back[1].fd, back[1].offset) == (4, 9, 2, 3, 5, 4096)
    assert (back[1].held, back[1].reply, back[1].rescale) == (1, 1, 7)
    pull = next(PULL.unpack(PULL.pack([(7, 0, 1, 1, 0, float_bits(0.03125), 1)])))
    assert pull.shm == 1 and bits_float(pull.rescale) == 0.03125 and float_bits(0.0) == 0 and pull.mirror == 1
    assert next(ANSWER.unpack(ANSWER.pack([(0, -1, 0, 16)]))).nbytes == 16
    with pytest.raises(ValueError, match="PullRow row has 7 columns"):
        PULL.pack([(1, 2)])
    with pytest.raises(ProtocolError, match="not rows of 7 int64"):
        PULL.unpack(b"\x00" * 24)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float64])
def test_tensor_frames_for_every_dtype(dtype: torch.dtype) -> None:
    t = (torch.arange(5) % 2).to(dtype)
    assert torch.equal(frame_tensor(bytes(tensor_frame(t)), dtype, 5), t)
    assert torch_dtype(dtype_name(dtype)) == dtype


def test_a_frame_at_any_address_gives_an_aligned_tensor() -> None:
    # zmq hands over small frames 2-byte aligned; complex128 kernels crash (SIGSEGV) on memory not 16-byte
    # aligned, which took a server down at the INIT of any complex128 key
    t = torch.arange(3.0).to(torch.complex128) * (1 + 1j)
    buf = bytearray(16 + 8 + t.numel() * 16)
    at = 8 + -torch.frombuffer(buf, dtype=torch.uint8).data_ptr() % 16  # 8 bytes past a 16-byte boundary
    buf[at : at + 48] = bytes(tensor_frame(t))
    back = frame_tensor(memoryview(buf)[at : at + 48], torch.complex128, 3)
    assert back.data_ptr() % 16 == 0 and torch.equal(back, t)
    floats = frame_tensor(memoryview(buf)[at : at + 48], torch.float32, 12)  # aligned to its items: a view, no copy
    assert floats.data_ptr() == torch.frombuffer(buf, dtype=torch.uint8).data_ptr() + at


def test_tensor_frame_is_a_view_not_a_copy() -> None:
    t = torch.zeros(4)
    view = tensor_frame(t)
    t.fill_(1.0)
    assert bytes(view) == bytes(tensor_frame(torch.ones(4)))


def _head(**kw: int) -> bytes:
    f = {"magic": MAGIC, "version": VERSION, "type": int(Type.PULL), "meta_len": 0, **kw}
    return HEADER.pack(f["magic"], f["version"], f["type"], 0, f["meta_len"])


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty message"),
        ([b"PSKV"], "header is 4 bytes"),
        ([b"\x00" * HEADER.size], "bad magic"),
        ([_head(version=9)], "wire version 9"),
        ([_head(type=99)], "unknown message type 99"),
        ([_head(meta_len=10)], "without a metadata frame"),
        ([_head(meta_len=3), b"{}"], "metadata frame is 2 bytes"),
        ([_head(meta_len=4), b"{no}"], "not JSON"),
        ([_head(meta_len=2), b"[]"], "must be a JSON object"),
        ([_head(meta_len=2), b"\xff\xfe"], "not JSON"),
        ([_head(meta_len=1 << 21), b"x"], "over"),
        ([pickle.dumps({"a": 1})], "header is"),
        ([b"PSKVAUTH" + bytes(57)], "a proof of PSKV_SECRET reached a process that has no secret"),  # (was: "header is 65 bytes")
    ],
)
def test_malformed_messages_are_protocol_errors(frames: list[bytes], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        decode(frames)


def test_payload_size_and_dtype_are_checked() -> None:
    with pytest.raises(ProtocolError, match="expected 3 x 4"):
        frame_tensor(b"\x00" * 8, torch.float32, 3)
    with pytest.raises(ProtocolError, match="whole number"):
        frame_tensor(b"\x00" * 7, torch.float32)
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        torch_dtype("object")
    with pytest.raises(ProtocolError, match="unsupported dtype"):
        torch_dtype("__import__('os')")


def test_meta_is_plain_json() -> None:
    frames = encode(Message(Type.ERROR, meta={"kind": "KVStoreError", "message": "x"}))
    assert json.loads(frames[1]) == {"kind": "KVStoreError", "message": "x"}
    with pytest.raises(ValueError):
        encode(Message(Type.ERROR, meta={"nan": float("nan")}))
