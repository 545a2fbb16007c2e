"""Every exception pskv raises, in one tree.

::

    PSKVError
    ├── KVStoreError                  a store call was given something it cannot take
    │   ├── KeyNotInitializedError    the key was never ``init``-ed
    │   ├── DuplicateInitError        the key was ``init``-ed before
    │   ├── KeyTypeError              a key that is not int/str, or int and str keys mixed
    │   ├── ShapeMismatchError        a value's shape differs from the key's
    │   ├── DTypeMismatchError        a value's dtype differs from the key's
    │   ├── SparseError               row-sparse misuse (dense ``out`` for a row-sparse key, bad row ids)
    │   ├── ValueCountError           lists of keys/values/outputs of different lengths, empty lists
    │   ├── InvalidValueError         a value that is not a tensor (or list of tensors)
    │   ├── OptimizerRequiredError    ``dist_async`` push without a server-side optimizer
    │   └── StoreClosedError          a call after ``close()``
    ├── OptimizerError                unknown optimizer or bad hyperparameter (also ``ValueError``)
    ├── CompressionError              bad gradient-compression parameters (also ``ValueError``)
    ├── TrainerError                  a Trainer given parameters or settings it cannot use
    ├── ClusterError                  the distributed system could not do what was asked
    │   ├── DeadlineExceeded          a blocking call ran past ``PSKV_TIMEOUT`` (also ``TimeoutError``)
    │   ├── NodeFailedError           a scheduler/server/worker died or left
    │   └── ProtocolError             a malformed message arrived
    └── LaunchError                   ``pskv launch`` could not start or keep a job running

Errors raised on a server travel back to the worker as a kind name plus text, and are raised
there as the class of that name (looked up in this module, never evaluated). The errors that
say what a wait is missing (deadlines, lost and finished nodes) are worded at the end of this
module, whichever part of the system notices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class PSKVError(Exception):
    """Base class of every pskv exception."""


class KVStoreError(PSKVError):
    """A store call was given something it cannot take; the store stays usable."""


class KeyNotInitializedError(KVStoreError):
    """The key was never ``init``-ed."""


class DuplicateInitError(KVStoreError):
    """The key was ``init``-ed before."""


class KeyTypeError(KVStoreError, TypeError):
    """A key that is not an int or str, or int and str keys mixed in one store."""


class ShapeMismatchError(KVStoreError, ValueError):
    """A value's shape differs from the shape the key was initialised with."""


class DTypeMismatchError(KVStoreError, TypeError):
    """A value's dtype differs from the dtype the key was initialised with."""


class SparseError(KVStoreError, ValueError):
    """Row-sparse misuse: a dense ``out`` for a row-sparse key, bad ``row_ids``, a bad layout."""


class ValueCountError(KVStoreError, ValueError):
    """Lists of keys, values, outputs or row ids whose lengths do not match (or are empty)."""


class InvalidValueError(KVStoreError, TypeError):
    """A value or output that is not a tensor or a list of tensors."""


class OptimizerRequiredError(KVStoreError):
    """``dist_async`` applies pushes on the servers, so it needs ``set_optimizer`` first."""


class StoreClosedError(KVStoreError):
    """The store was closed."""


class OptimizerError(PSKVError, ValueError):
    """Unknown optimizer name, unknown or invalid hyperparameter, bad state file."""


class CompressionError(PSKVError, ValueError):
    """Invalid gradient-compression parameters."""


class TrainerError(PSKVError, ValueError):
    """A Trainer given parameters or settings it cannot use (e.g. allreduce_grads with update_on_kvstore)."""


class ClusterError(PSKVError):
    """The distributed system could not complete a request."""


class DeadlineExceeded(ClusterError, TimeoutError):
    """A blocking call passed its deadline; the message says what is missing."""


class NodeFailedError(ClusterError):
    """A node (scheduler, server or worker) died or left the job."""


class ProtocolError(ClusterError):
    """A message that does not follow pskv's wire format."""


class LaunchError(PSKVError):
    """``pskv launch`` could not start the job or a process of it failed."""


# -- what is missing: every error of SPEC section 9 ("never a silent hang") is worded here ------------


def deadline(what: str, waited: float, setting: str, limit: float, missing: str) -> DeadlineExceeded:
    """``what`` waited ``waited`` s, past ``setting``, for ``missing`` (who has not done what)."""
    return DeadlineExceeded(f"{what} waited {waited:.0f} s ({setting}={limit:g}) for {missing}")


def describe_node(info: Mapping[str, Any]) -> str:
    """``"server 1 (host 10.0.0.2, pid 4242)"`` from a node-table entry."""
    where = f"host {info.get('hostname') or info.get('host')}, pid {info.get('pid')}"
    return f"{info.get('role')} {info.get('rank')} ({where})"


def node_failed(info: Mapping[str, Any], reason: str) -> NodeFailedError:
    """A node of the job is gone: which one (role, rank, host, pid) and how it was noticed."""
    return NodeFailedError(f"{describe_node(info)} failed: {reason}")


def finished_without(who: str, what: str) -> NodeFailedError:
    """A wait that can never end: ``who`` finished (closed its store) without ``what``."""
    return NodeFailedError(f"{who} finished (closed its store) without {what}; it can never complete")


def from_reply(meta: Any, context: str = "") -> PSKVError:
    """The exception an ERROR message's metadata carries, its text prefixed with ``context``."""
    meta = meta if isinstance(meta, dict) else {}
    return error_class(str(meta.get("kind", "")))(f"{context}{meta.get('message', 'unknown error')}")


def error_class(kind: str) -> type[PSKVError]:
    """The exception class named ``kind`` (as sent by a server); ``ClusterError`` if unknown.

    Only classes defined in this module are returned: a name received over the network
    selects from this fixed table and is never evaluated.
    """
    cls = _BY_NAME.get(kind)
    return cls if cls is not None else ClusterError


_BY_NAME: dict[str, type[PSKVError]] = {
    cls.__name__: cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, PSKVError)
}
