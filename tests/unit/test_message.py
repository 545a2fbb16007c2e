"""The wire format: round trips, and every malformed input is a ProtocolError."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from pskv.errors import ProtocolError
from pskv.ps.message import (
    HEADER,
    MAGIC,
    Flag,
    Message,
    Type,
    decode,
    dtype_name,
    encode,
    frame_tensor,
    tensor_frame,
    torch_dtype,
)


def test_roundtrip_with_meta_and_frames() -> None:
    t = torch.arange(6, dtype=torch.float32)
    msg = Message(Type.PUSH, req_id=7, key=3, part=1, a=-2, b=5, c=9, flags=Flag.SPARSE, sender=4, meta={"x": [1, 2]}, frames=[tensor_frame(t)])
    back = decode([bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in encode(msg)])
    assert (back.type, back.req_id, back.key, back.part, back.a, back.b, back.c) == (Type.PUSH, 7, 3, 1, -2, 5, 9)
    assert back.flags == Flag.SPARSE and back.sender == 4 and back.meta == {"x": [1, 2]}
    assert torch.equal(frame_tensor(back.frames[0], torch.float32, 6), t)


def test_no_meta_means_no_meta_frame() -> None:
    frames = encode(Message(Type.PULL, key=1))
    assert len(frames) == 1 and len(frames[0]) == HEADER.size
    assert decode(frames).meta is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.float64])
def test_tensor_frames_for_every_dtype(dtype: torch.dtype) -> None:
    t = (torch.arange(5) % 2).to(dtype)
    assert torch.equal(frame_tensor(bytes(tensor_frame(t)), dtype, 5), t)
    assert torch_dtype(dtype_name(dtype)) == dtype


def test_tensor_frame_is_a_view_not_a_copy() -> None:
    t = torch.zeros(4)
    view = tensor_frame(t)
    t.fill_(1.0)
    assert bytes(view) == bytes(tensor_frame(torch.ones(4)))


def _head(**kw: int) -> bytes:
    f = {"magic": MAGIC, "version": 1, "type": int(Type.PULL), "flags": 0, "meta_len": 0, **kw}
    return HEADER.pack(f["magic"], f["version"], f["type"], f["flags"], -1, 0, 0, 0, 0, 0, 0, f["meta_len"])


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([], "empty message"),
        ([b"PSKV"], "header is 4 bytes"),
        ([b"\x00" * HEADER.size], "bad magic"),
        ([_head(version=9)], "wire version 9"),
        ([_head(type=99)], "unknown message type 99"),
        ([_head(flags=64)], "flags 64"),
        ([_head(meta_len=10)], "without a metadata frame"),
        ([_head(meta_len=3), b"{}"], "metadata frame is 2 bytes"),
        ([_head(meta_len=4), b"{no}"], "not JSON"),
        ([_head(meta_len=2), b"[]"], "must be a JSON object"),
        ([_head(meta_len=2), b"\xff\xfe"], "not JSON"),
        ([_head(meta_len=1 << 21), b"x"], "over"),
        ([pickle.dumps({"a": 1})], "header is"),
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
