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
there as the class of that name (looked up in this module, never evaluated).
"""

from __future__ import annotations


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
