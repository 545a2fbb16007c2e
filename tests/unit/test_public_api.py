"""The public surface is exactly what __all__ says, sorted, and importable."""

from __future__ import annotations

import subprocess
import sys

import pskv

EXPECTED = [
    "ClusterError",
    "CompressionError",
    "ConfigError",
    "DTypeMismatchError",
    "DeadlineExceeded",
    "DistributedOptimizer",
    "DuplicateInitError",
    "InvalidValueError",
    "KVStoreError",
    "KeyNotInitializedError",
    "KeyTypeError",
    "LaunchError",
    "NodeFailedError",
    "NonFiniteError",
    "OptimizerError",
    "OptimizerRequiredError",
    "PSKVError",
    "ProtocolError",
    "ShapeMismatchError",
    "SparseError",
    "StoreClosedError",
    "Trainer",
    "TrainerError",
    "ValueCountError",
    "__version__",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "checkpoint",
    "compression",
    "data",
    "ddp_hook",
    "kv",
    "optim",
    "split_and_load",
]


def test_all_is_pinned_and_sorted() -> None:
    assert pskv.__all__ == EXPECTED
    assert pskv.__all__ == sorted(pskv.__all__)
    for name in pskv.__all__:
        assert getattr(pskv, name) is not None


def test_every_error_is_a_pskv_error() -> None:
    for name in pskv.__all__:
        obj = getattr(pskv, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, pskv.PSKVError)
    classes = {n for n, c in vars(pskv.errors).items() if isinstance(c, type) and issubclass(c, pskv.PSKVError)}
    assert sorted(classes) == pskv.errors.__all__  # every error class is public, listed once


def test_importing_pskv_does_not_load_torch() -> None:
    """The scheduler imports pskv and moves only control messages: it must start fast."""
    code = "import sys, pskv, pskv.errors, pskv.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
