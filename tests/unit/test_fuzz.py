"""Fuzzing the wire: generated and mutated messages at the decoder and at a server's request
handling (no sockets: the server's transport is replaced by a recorder). Whatever arrives, the
decoder gives a message or a ProtocolError, and the server answers with an ERROR or a reply and
never reaches its bug path (which prints a traceback); afterwards it still serves a correct round."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pskv.errors import ProtocolError
from pskv.ps import server as server_module
from pskv.ps.message import (
    HEADER,
    MAGIC,
    PULL,
    PUSH,
    VERSION,
    Message,
    Type,
    decode,
    encode,
    float_bits,
    tensor_frame,
)

TYPES = [int(t) for t in Type]
DTYPE_NAMES = [
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int64",
    "bool",
    "complex64",
    "object",
    "",
    7,
    None,
]
OPTIMIZERS = ["sgd", "adam", "adamw", "adagrad", "nope", "__import__", 3, None]


def _junk(rng: random.Random) -> Any:
    return rng.choice(
        [None, True, -1, 0, 1, 2**62, 2**70, -(2**63), 1.5, math.pi, "x", "float32", [], [1, 2], {}, {"a": 1}]
    )


def _small(rng: random.Random) -> int:
    """Mostly plausible column values (keys, parts, rounds, counts), sometimes extreme ones."""
    return rng.choice([0, 0, 1, 1, 2, 3, rng.randrange(8), -1, 2**31, 2**62, -(2**63), 2**63 - 1])


def _frame(rng: random.Random) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(rng.choice([0, 1, 4, 7, 8, 16, 32, 64])))


def _floats(rng: random.Random, n: int) -> bytes:
    return torch.tensor([rng.uniform(-2, 2) for _ in range(n)], dtype=torch.float32).numpy().tobytes()


def generated(rng: random.Random) -> Message:
    """A message as a confused or hostile worker would send it: the right types with wrong fields."""
    kind = rng.choice([Type.INIT, Type.PUSH, Type.PULL, Type.SET_OPTIMIZER, Type.GET_STATES, Type.SET_STATES,
                       Type.SHM_PROBE, Type.HELLO, Type(rng.choice(TYPES))])  # fmt: skip
    req = rng.choice([0, 1, rng.randrange(1, 1000), -1, 2**62])
    if kind == Type.INIT:
        numel = rng.choice([1, 4, 4, 8, 8, 0, -3, 2**27, 2**62])
        dtype = "float32" if rng.random() < 0.5 else rng.choice(DTYPE_NAMES)
        row = [_small(rng) % 8, _small(rng) % 2, dtype, numel, rng.choice([1, 1, 1, 2, 4, 0, -1]), False, "k"]
        if rng.random() < 0.2:
            row[rng.randrange(len(row))] = _junk(rng)
        frames = (
            [_floats(rng, max(0, min(numel, 16)))]
            if rng.random() < 0.6
            else [_frame(rng) for _ in range(rng.randrange(3))]
        )
        meta = {
            "mode": rng.choice(["sync", "async", "x"]),
            "parts": rng.choice([[row], [row, row], [], "parts"]),
        }
        return Message(kind, req, meta, frames)
    if kind in (Type.PUSH, Type.PULL):
        layout = PUSH if kind == Type.PUSH else PULL
        rows = [[_small(rng) for _ in range(layout.width)] for _ in range(rng.randrange(1, 4))]
        for row in rows:  # most rows plausible, so that merges, updates and answers run too
            if rng.random() < 0.3:
                continue
            if kind == Type.PUSH:
                row[:] = [
                    row[0] % 8,
                    row[1] % 2,
                    rng.randrange(1, 4),
                    rng.choice([0, 0, 1, 2]),
                    1,
                    -1,
                    0,
                    rng.randrange(2),
                    rng.randrange(2),
                    rng.choice([0, 0, float_bits(0.25), float_bits(float("nan"))]),  # a rescale (async), or none
                ]
            else:
                row[:] = [row[0] % 8, row[1] % 2, rng.randrange(4), 0, rng.randrange(2), 0, rng.randrange(2)]
        table = layout.pack(rows) if rng.random() < 0.9 else _frame(rng)
        payload = [
            _floats(rng, rng.choice([1, 4, 8])) if rng.random() < 0.5 else _frame(rng)
            for _ in range(rng.randrange(4))
        ]
        meta = (
            {
                "codec": rng.choice(
                    [{"type": "2bit", "threshold": 0.5}, {"type": "1bit"}, {"type": "zzz"}, _junk(rng)]
                )
            }
            if rng.random() < 0.3
            else None
        )
        return Message(kind, req, meta, [table, *payload])
    if kind == Type.SET_OPTIMIZER:
        hyper = {
            rng.choice(["learning_rate", "momentum", "wd", "lr", "beta1", "nesterov"]): _junk(rng)
            for _ in range(rng.randrange(3))
        }
        desc = {"name": rng.choice(OPTIMIZERS), "hyper": hyper} if rng.random() < 0.8 else _junk(rng)
        return Message(kind, req, {"optimizer": desc, "keep_states": _junk(rng)})
    if kind == Type.SET_STATES:
        part = {
            "key": _small(rng) % 8,
            "part": _small(rng) % 2,
            "step": _junk(rng),
            "names": rng.choice([["momentum_buffer"], ["exp_avg"], [], "x", [1]]),
        }
        if rng.random() < 0.3:
            part[rng.choice(list(part))] = _junk(rng)
        meta = {"optimizer": {"name": rng.choice(OPTIMIZERS), "hyper": {}}, "num_update": _junk(rng)}
        table = json.dumps(rng.choice([[part], [], _junk(rng)])).encode()  # the parts' table: a JSON frame
        return Message(kind, req, meta, [table, *(_floats(rng, rng.choice([1, 4])) for _ in range(rng.randrange(3)))])
    meta = {
        "rank": _junk(rng),
        "answers": _junk(rng),
        "pid": _junk(rng),
        "fd": _junk(rng),
        "token": _junk(rng),
    }
    return Message(
        kind, req, meta if rng.random() < 0.7 else None, [_frame(rng) for _ in range(rng.randrange(3))]
    )


def mutated(frames: list[Any], rng: random.Random) -> list[bytes]:
    """``frames`` with bytes flipped, frames cut, dropped, repeated or added."""
    out = [bytes(f) for f in frames]
    for _ in range(rng.randrange(1, 4)):
        i = rng.randrange(len(out)) if out else 0
        op = rng.randrange(6)
        if op == 0 and out and out[i]:
            b = bytearray(out[i])
            b[rng.randrange(len(b))] = rng.getrandbits(8)
            out[i] = bytes(b)
        elif op == 1 and out:
            out[i] = out[i][: rng.randrange(len(out[i]) + 1)]
        elif op == 2 and out:
            del out[i]
        elif op == 3 and out:
            out.insert(i, out[i])
        elif op == 4:
            out.insert(i, _frame(rng))
        else:
            out.append(rng.choice([_frame(rng), json.dumps({"k": 1}).encode()]))
    return out


def test_the_decoder_takes_100000_generated_and_mutated_messages() -> None:
    rng = random.Random(20261123)
    decoded = refused = 0
    for i in range(100_000):
        frames = encode(generated(rng))
        if i % 2:
            frames = mutated(frames, rng)
        try:
            msg = decode(frames)
        except ProtocolError:
            refused += 1
            continue
        assert isinstance(msg, Message)
        decoded += 1
    assert decoded > 10_000 and refused > 10_000  # both paths were exercised


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.binary(max_size=64), max_size=5),
    st.integers(0, 255),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 2**32 - 1),
)
def test_the_decoder_refuses_or_decodes_any_frames(
    frames: list[bytes], mtype: int, req: int, meta_len: int
) -> None:
    for candidate in (frames, [HEADER.pack(MAGIC, VERSION, mtype, req, meta_len), *frames]):
        try:
            msg = decode(candidate)
        except ProtocolError:
            continue
        assert (
            msg.type == Type(mtype) and msg.req_id == req and (msg.meta is None or isinstance(msg.meta, dict))
        )


def test_a_server_takes_100000_generated_and_mutated_requests(monkeypatch: pytest.MonkeyPatch, offline_server: Any) -> None:
    bugs: list[str] = []
    monkeypatch.setattr(server_module.traceback, "print_exc", lambda *a, **k: bugs.append(repr(a)))
    off = offline_server()
    rng = random.Random(7)
    for i in range(100_000):
        frames = encode(generated(rng))
        off.deliver(
            rng.choice(["w0", "w1", "w0", "w1", "stranger"]), mutated(frames, rng) if i % 3 == 0 else frames
        )
        if len(off.replies) > 1000:
            off.replies.clear()
    assert not bugs, bugs[:3]
    assert off.server.status is None  # no worker can stop a server
    kinds = {(m.meta or {}).get("kind") for _, m in off.replies if m.type == Type.ERROR}
    assert "ClusterError" not in kinds  # the bug path's answer

    # still serving, with values that follow the formula: a new key, sgd lr=1, one round of both
    # workers on new connections (fuzzed HELLOs claimed ranks on w0, w1 and stranger: without a job
    # secret a server cannot tell them from the real workers, issue 14)
    off.replies.clear()
    for rank in (0, 1):
        assert [
            m.type for m in off.send(f"v{rank}", Message(Type.HELLO, meta={"rank": rank, "answers": True}))
        ] == [Type.OK]
    key, init = 10**6, torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert (
        off.send(
            "v0",
            Message(Type.SET_OPTIMIZER, 1, {"optimizer": {"name": "sgd", "hyper": {"learning_rate": 1.0}}}),
        )[-1].type
        == Type.OK
    )
    parts = [[key, 0, "float32", 4, 1, False, "fresh"]]
    off.send("v0", Message(Type.INIT, 2, {"mode": "sync", "parts": parts}, [tensor_frame(init)]))
    off.send("v1", Message(Type.INIT, 2, {"mode": "sync", "parts": parts}))
    for rank in (0, 1):
        grad = torch.full((4,), rank + 1.0)
        off.send(
            f"v{rank}",
            Message(Type.PUSH, 3, None, [PUSH.pack([(key, 0, 1, 0, 1, -1, 0, 0, 0, 0)]), tensor_frame(grad)]),
        )
    answer = off.send("v0", Message(Type.PULL, 4, None, [PULL.pack([(key, 0, 1, 0, 0, 0, 0)])]))[-1]
    assert answer.type == Type.DATA, answer.meta
    value = torch.frombuffer(bytearray(bytes(answer.frames[-1])), dtype=torch.float32)
    assert torch.equal(value, init - 1.0 * (1.0 + 2.0))


def test_fuzz_helpers_make_what_they_say() -> None:
    rng = random.Random(1)
    kinds = {generated(rng).type for _ in range(2000)}
    assert {Type.INIT, Type.PUSH, Type.PULL, Type.SET_OPTIMIZER, Type.SET_STATES} <= kinds
    frames = encode(Message(Type.PULL, 5, {"a": 1}, [b"x" * 8]))
    assert any(mutated(frames, rng) != [bytes(f) for f in frames] for _ in range(20))
