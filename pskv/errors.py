"""Every exception pskv raises, in one tree. Errors raised on a server travel back to the worker as
a kind name plus text, and are raised there as the class of that name (looked up in this module,
never evaluated). The errors that say what a wait is missing (deadlines, lost and finished nodes)
are worded at the end of this module, whichever part of the system notices."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [  # the error classes: what ``from pskv.errors import *`` gives
    "ClusterError", "CompressionError", "ConfigError", "DTypeMismatchError", "DeadlineExceeded", "DuplicateInitError",
    "InvalidValueError", "KVStoreError", "KeyNotInitializedError", "KeyTypeError", "LaunchError",
    "NodeFailedError", "NonFiniteError", "OptimizerError", "OptimizerRequiredError", "PSKVError", "ProtocolError",
    "ShapeMismatchError", "SparseError", "StoreClosedError", "TrainerError", "ValueCountError",
]


# The tree of errors; a builtin second base lets callers catch e.g. any bad value as ValueError.
class PSKVError(Exception): ...
class KVStoreError(PSKVError): ...  # a call given what it cannot take (the store stays usable)
class KeyNotInitializedError(KVStoreError): ...  # the key was never ``init``-ed
class DuplicateInitError(KVStoreError): ...  # the key was ``init``-ed before
class KeyTypeError(KVStoreError, TypeError): ...  # a key that is not int/str, or int and str keys mixed
class ShapeMismatchError(KVStoreError, ValueError): ...  # a value's shape differs from the key's
class DTypeMismatchError(KVStoreError, TypeError): ...  # a value's dtype differs from the key's
class SparseError(KVStoreError, ValueError): ...  # dense ``out`` for a row-sparse key, bad row ids
class ValueCountError(KVStoreError, ValueError): ...  # unequal numbers of keys and values, empty lists
class InvalidValueError(KVStoreError, TypeError): ...  # a value that is not a tensor (or list of tensors)
class NonFiniteError(KVStoreError, ValueError): ...  # a pushed gradient with NaN or Inf (PSKV_NONFINITE)
class OptimizerRequiredError(KVStoreError): ...  # ``dist_async`` push without a server-side optimizer
class StoreClosedError(KVStoreError): ...  # a call after ``close()``
class OptimizerError(PSKVError, ValueError): ...  # unknown optimizer, bad hyperparameter or state file
class CompressionError(PSKVError, ValueError): ...  # bad gradient-compression parameters
class TrainerError(PSKVError, ValueError): ...  # a Trainer given parameters or settings it cannot use
class ClusterError(PSKVError): ...  # the distributed system could not do what was asked
class ConfigError(ClusterError, ValueError): ...  # a PSKV_* variable that does not parse (pskv.config)
class DeadlineExceeded(ClusterError, TimeoutError): ...  # a blocking call ran past ``PSKV_TIMEOUT``
class NodeFailedError(ClusterError): ...  # a scheduler/server/worker died or left
class ProtocolError(ClusterError): ...  # a malformed message arrived
class LaunchError(PSKVError): ...  # ``pskv launch`` could not start or keep a job running

_BY_NAME = {name: cls for name, cls in globals().items() if isinstance(cls, type) and issubclass(cls, PSKVError)}


# -- what is missing: every error of SPEC section 9 ("never a silent hang") is worded here --------


def deadline(what: str, waited: float, setting: str, limit: float, missing: str) -> DeadlineExceeded:
    """``what`` waited ``waited`` s, past ``setting``, for ``missing`` (who has not done what)."""
    return DeadlineExceeded(f"{what} waited {waited:.0f} s ({setting}={limit:g}) for {missing}")


def describe_node(info: Mapping[str, Any]) -> str:
    """``"server 1 (host 10.0.0.2, pid 4242)"`` from a node-table entry."""
    where = f"host {info.get('hostname') or info.get('host')}, pid {info.get('pid')}"
    rank = info.get("rank")
    return f"{info.get('role')} {rank} ({where})" if not isinstance(rank, int) or rank >= 0 else f"a {info.get('role')} ({where}, no rank yet)"


def node_failed(info: Mapping[str, Any], reason: str) -> NodeFailedError:
    """A node of the job is gone: which one (role, rank, host, pid) and how it was noticed."""
    return NodeFailedError(f"{describe_node(info)} failed: {reason}")


def finished_without(who: str, what: str) -> NodeFailedError:
    """A wait that can never end: ``who`` finished (closed its store) without ``what``."""
    return NodeFailedError(f"{who} finished (closed its store) without {what}; it can never complete")


def from_reply(meta: Any, context: str) -> PSKVError:
    """The exception an ERROR message's metadata carries, its text prefixed with ``context``: the class
    of this module its ``kind`` names (never evaluated), ``ClusterError`` if none."""
    meta = meta if isinstance(meta, dict) else {}
    error_class = _BY_NAME.get(str(meta.get("kind", "")), ClusterError)
    return error_class(f"{context}{meta.get('message', 'unknown error')}")
