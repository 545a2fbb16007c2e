"""pskv: MXNet-style parameter-server training on PyTorch tensors (examples: README.md). Submodules
that need torch are imported on first use, so that a scheduler process (which moves only control
messages) starts without loading torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import errors
from .errors import *  # noqa: F403  (every error class)

__version__ = "0.1.0"

if TYPE_CHECKING:
    from . import checkpoint as checkpoint  # "as": re-exported, for type checkers
    from . import compression as compression
    from . import data as data
    from . import kv as kv
    from . import optim as optim
    from .data import split_and_load as split_and_load
    from .ddp import ddp_hook as ddp_hook
    from .distributed import DistributedOptimizer as DistributedOptimizer
    from .distributed import broadcast_optimizer_state as broadcast_optimizer_state
    from .distributed import broadcast_parameters as broadcast_parameters
    from .trainer import Trainer as Trainer

# Imported on first use: the submodules themselves, and names from them.
_SUBMODULES = ("checkpoint", "compression", "data", "kv", "optim")
_NAMES = {"split_and_load": "pskv.data", "Trainer": "pskv.trainer", "ddp_hook": "pskv.ddp", **dict.fromkeys(
    ("DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state"), "pskv.distributed")}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"pskv.{name}")  # the import sets it on pskv too
    if name in _NAMES:
        value = globals()[name] = getattr(importlib.import_module(_NAMES[name]), name)
        return value
    raise AttributeError(f"module 'pskv' has no attribute {name!r}")


__all__ = sorted([*errors.__all__, "__version__", *_SUBMODULES, *_NAMES])
