"""Optimizers that run where the weights live: in the worker's process or on the servers. An
:class:`Optimizer` is a description that travels as JSON (docs/SPEC.md, section 4 and "Optimizers")
plus update rules in torch ops that follow ``torch.optim``'s code operation by operation (SGD: its
fused kernel, the arithmetic of ``torch.optim.SGD(fused=True)``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from .errors import OptimizerError
from .ops import write_rows

Hyper = dict[str, Union[int, float, bool]]

_COMMON: Hyper = {"learning_rate": 0.01, "wd": 0.0, "rescale_grad": 1.0, "clip_gradient": -1.0}

# Names a user coming from torch.optim may type, and what pskv calls them.
_ALIASES = {"lr": "learning_rate", "weight_decay": "wd", "eps": "epsilon", "betas": "beta1 and beta2",
            "initial_accumulator": "initial_accumulator_value", "clip_grad": "clip_gradient"}


@dataclass
class KeyState:
    """What one key's optimizer keeps: its update count and named state tensors."""

    step: int
    tensors: dict[str, Tensor]


def _rows(g: Tensor) -> tuple[Tensor, Tensor]:
    """Row indices (unique, sorted) and row values of a row-sparse tensor."""
    g = g.coalesce()
    return g.indices()[0], g.values()


# Update rules: dense(hyper, lr, state, grad, weight) and sparse(hyper, lr, state, rows, values,
# weight) update the weight in place. The gradient has rescale_grad and clip_gradient applied; a
# dense one may be the caller's unless _Rule.writes_grad (rows are unique and sorted; values are not written).
def _sgd(h: Hyper, lr: float, states: Sequence[KeyState], gs: list[Tensor], ws: list[Tensor]) -> None:
    """SGD of one key or of many on one device in torch's fused kernel, a call per dtype: one pass
    over weight, gradient and momentum (the gradient is not written), as ``torch.optim.SGD(fused=True)``."""
    momentum = float(h["momentum"])
    kinds = [(w.dtype, momentum != 0 and st.step <= 1) for w, st in zip(ws, states)]  # first step: momentum = gradient
    for dtype, first in set(kinds):
        ks = [k for k, x in enumerate(kinds) if x == (dtype, first)]
        w, g, b = [ws[k] for k in ks], [gs[k] for k in ks], [states[k].tensors["momentum_buffer"] for k in ks] if momentum else []
        low = dtype in (torch.float16, torch.bfloat16) and w[0].device.type == "cpu"  # torch's CPU kernel leaves their
        # vectorised elements as they were (in float32 then, as its own arithmetic, and rounded back); it also walks each
        # tensor's memory in order: a weight that is a slice, or strides unlike its gradient's or momentum's, go by contiguous copies
        walks = [(u.is_contiguous() or (u.dim() == 4 and u.is_contiguous(memory_format=torch.channels_last))) and all(
            t.stride() == u.stride() for t in (g[k], *b[k : k + 1])) for k, u in enumerate(w)]
        w32, g32, b32 = ([u if walks[k] else u.contiguous() for k, u in enumerate(t.float() if low else t for t in ts)] for ts in (w, g, b))
        torch._fused_sgd_(w32, g32, b32, weight_decay=float(h["wd"]), momentum=momentum, lr=lr, dampening=float(h["dampening"]),
                          nesterov=bool(h["nesterov"]), maximize=False, is_first_step=first)
        if back := [(t, c) for t, c in zip(w + b, w32 + b32) if c is not t]:
            torch._foreach_copy_([t for t, _ in back], [c for _, c in back])


def _sgd_sparse(h: Hyper, lr: float, st: KeyState, rows: Tensor, vals: Tensor, w: Tensor) -> None:
    if h["wd"] == 0 and h["momentum"] == 0:
        w.index_add_(0, rows, vals, alpha=-lr)  # what torch.optim.SGD does with a sparse grad
        return
    # lazy: the dense rule on the rows present, then those rows written back
    wr = w.index_select(0, rows)
    st_rows = KeyState(st.step, {n: t.index_select(0, rows) for n, t in st.tensors.items()})
    _sgd(h, lr, [st_rows], [vals], [wr])  # (the fused kernel does not write the gradient)
    w.index_copy_(0, rows, wr)
    for n, t in st_rows.tensors.items():
        st.tensors[n].index_copy_(0, rows, t)


def _adam_dense(h: Hyper, lr: float, st: KeyState, g: Tensor, w: Tensor, decoupled: bool = False) -> None:
    b1, b2, wd = float(h["beta1"]), float(h["beta2"]), float(h["wd"])
    if wd != 0:
        if decoupled:
            w.mul_(1 - lr * wd)
        else:
            g.add_(w, alpha=wd)
    m, v = st.tensors["exp_avg"], st.tensors["exp_avg_sq"]
    m.lerp_(g, 1 - b1)
    v.mul_(b2).addcmul_(g, g, value=1 - b2)
    bias_correction1, bias_correction2 = 1 - b1**st.step, 1 - b2**st.step
    denom = torch.sqrt(v, out=g).div_(bias_correction2**0.5).add_(h["epsilon"])  # g is no longer needed
    w.addcdiv_(m, denom, value=-lr / bias_correction1)


def _adam_sparse(h: Hyper, lr: float, st: KeyState, rows: Tensor, vals: Tensor, w: Tensor, decoupled: bool = False) -> None:
    # torch.optim.SparseAdam's arithmetic, on rows instead of sparse tensors
    b1, b2, wd = float(h["beta1"]), float(h["beta2"]), float(h["wd"])
    if wd != 0:
        wr = w.index_select(0, rows)
        if decoupled:
            w.index_copy_(0, rows, wr.mul_(1 - lr * wd))
        else:
            vals = vals.add(wr, alpha=wd)
    m, v = st.tensors["exp_avg"], st.tensors["exp_avg_sq"]
    old_m = m.index_select(0, rows)
    upd_m = vals.sub(old_m).mul_(1 - b1)
    m.index_add_(0, rows, upd_m)
    old_v = v.index_select(0, rows)
    upd_v = vals.pow(2).sub_(old_v).mul_(1 - b2)
    v.index_add_(0, rows, upd_v)
    numer = upd_m.add_(old_m)
    denom = upd_v.add_(old_v).sqrt_().add_(h["epsilon"])
    bias_correction1, bias_correction2 = 1 - b1**st.step, 1 - b2**st.step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    w.index_add_(0, rows, -step_size * numer.div_(denom))


def _adagrad_dense(h: Hyper, lr: float, st: KeyState, g: Tensor, w: Tensor) -> None:
    if h["wd"] != 0:
        g.add_(w, alpha=h["wd"])
    acc = st.tensors["sum"]
    acc.addcmul_(g, g, value=1)
    std = acc.sqrt().add_(h["epsilon"])
    w.addcdiv_(g, std, value=-lr / (1 + (st.step - 1) * h["lr_decay"]))


def _adagrad_sparse(h: Hyper, lr: float, st: KeyState, rows: Tensor, vals: Tensor, w: Tensor) -> None:
    if h["wd"] != 0:  # torch refuses wd with sparse grads; lazily on the rows present here
        vals = vals.add(w.index_select(0, rows), alpha=h["wd"])
    acc = st.tensors["sum"]
    acc.index_add_(0, rows, vals.pow(2))
    std = acc.index_select(0, rows).sqrt_().add_(h["epsilon"])
    w.index_add_(0, rows, vals / std, alpha=-lr / (1 + (st.step - 1) * h["lr_decay"]))


@dataclass(frozen=True)
class _Rule:
    defaults: Hyper
    state: Callable[[Hyper], dict[str, float]]  # each state tensor's name and initial value
    dense: Callable[[Hyper, float, KeyState, Tensor, Tensor], None]
    sparse: Callable[[Hyper, float, KeyState, Tensor, Tensor, Tensor], None]
    writes_grad: Callable[[Hyper], bool]  # does ``dense`` overwrite its gradient?


_ADAM: Hyper = {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8}
_RULES = {
    "sgd": _Rule({"momentum": 0.0, "dampening": 0.0, "nesterov": False},
                 lambda h: {"momentum_buffer": 0.0} if h["momentum"] != 0 else {},
                 lambda h, lr, st, g, w: _sgd(h, lr, [st], [g], [w]), _sgd_sparse, lambda h: False),
    "adam": _Rule(_ADAM, lambda h: {"exp_avg": 0.0, "exp_avg_sq": 0.0}, _adam_dense, _adam_sparse,
                  lambda h: True),
    "adamw": _Rule({**_ADAM, "wd": 0.01}, lambda h: {"exp_avg": 0.0, "exp_avg_sq": 0.0},
                   partial(_adam_dense, decoupled=True), partial(_adam_sparse, decoupled=True), lambda h: True),
    "adagrad": _Rule({"epsilon": 1e-10, "lr_decay": 0.0, "initial_accumulator_value": 0.0},
                     lambda h: {"sum": float(h["initial_accumulator_value"])},
                     _adagrad_dense, _adagrad_sparse, lambda h: h["wd"] != 0),
}
OPTIMIZERS = tuple(sorted(_RULES))

# Each schedule's fields with their defaults (None: required).
_SCHEDULES: dict[str, dict[str, Any]] = {
    "step": {"step": None, "factor": 0.1},
    "multifactor": {"step": None, "factor": 0.1},
    "cosine": {"max_update": None, "final_lr": 0.0, "warmup_steps": 0, "warmup_begin_lr": 0.0},
}


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_schedule(spec: Mapping[str, Any]) -> dict[str, Any]:
    name = spec.get("name") if isinstance(spec, Mapping) else None
    if not isinstance(name, str) or name not in _SCHEDULES:
        raise OptimizerError(f"unknown lr_scheduler {spec!r}: it must be a dict with a 'name' out of {sorted(_SCHEDULES)}")
    out: dict[str, Any] = {"name": name}
    for field, default in _SCHEDULES[name].items():
        value = out[field] = spec.get(field, default)
        if value is None:
            raise OptimizerError(f"lr_scheduler {name!r} needs {field!r}")
        if (not _is_number(value) or value < 0) and (name, field) != ("multifactor", "step"):  # checked below
            raise OptimizerError(f"lr_scheduler {name!r}: {field} must be a number >= 0, got {value!r}")
    if unknown := set(spec) - set(out):
        raise OptimizerError(f"lr_scheduler {name!r} does not take {sorted(unknown)}")
    if name == "multifactor":
        steps = out["step"]
        if not isinstance(steps, list) or not steps or not all(_is_int(s) and s > 0 for s in steps):
            raise OptimizerError(f"lr_scheduler 'multifactor' needs 'step' as a list of positive ints, got {steps!r}")
        if steps != sorted(steps):
            raise OptimizerError(f"lr_scheduler 'multifactor' steps must increase, got {steps!r}")
    if name == "step" and not (_is_int(out["step"]) and out["step"] > 0):
        raise OptimizerError(f"lr_scheduler 'step' needs a positive int 'step', got {out['step']!r}")
    if name == "cosine" and not (_is_int(out["max_update"]) and out["max_update"] > out["warmup_steps"] >= 0):
        raise OptimizerError("lr_scheduler 'cosine' needs int max_update > warmup_steps >= 0")
    return out


def scheduled_lr(base_lr: float, schedule: Optional[Mapping[str, Any]], num_update: int) -> float:
    """The learning rate of update number ``num_update`` (1-based) under ``schedule``."""
    if schedule is None or num_update < 1:
        return base_lr
    name = schedule["name"]
    if name == "step":
        return float(base_lr * schedule["factor"] ** ((num_update - 1) // schedule["step"]))
    if name == "multifactor":
        return float(base_lr * schedule["factor"] ** sum(num_update > s for s in schedule["step"]))
    warm, top = schedule["warmup_steps"], schedule["max_update"]
    final, begin = schedule["final_lr"], schedule["warmup_begin_lr"]
    if num_update <= warm:
        return float(begin + (base_lr - begin) * num_update / warm)
    if num_update >= top:
        return float(final)
    return float(final + (base_lr - final) * (1 + math.cos(math.pi * (num_update - warm) / (top - warm))) / 2)


class Optimizer:
    """An optimizer description plus its per-key states (momentum buffers, moments, step counts).
    Build one with :func:`create`. Not thread-safe: one caller at a time (the weights' owner)."""

    def __init__(self, name: str, hyper: Mapping[str, Any], lr_scheduler: Optional[Mapping[str, Any]] = None):
        if not isinstance(name, str) or name.lower() not in _RULES:
            raise OptimizerError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")
        self.name = name.lower()
        self._rule = _RULES[self.name]
        self._defaults: Hyper = {**_COMMON, **self._rule.defaults}
        self._hyper = dict(self._defaults)
        self._set(hyper)
        self._schedule = None if lr_scheduler is None else _check_schedule(lr_scheduler)
        self.states: dict[int, KeyState] = {}
        self.num_update = 0

    def _set(self, hyper: Mapping[str, Any]) -> None:
        """Check ``hyper`` (names, types, ranges), then set it: a bad value changes nothing."""
        new = dict(self._hyper)
        for key, value in hyper.items():
            if key not in new:
                hint = f"; did you mean {_ALIASES[key]!r}?" if key in _ALIASES else ""
                takes = ", ".join(sorted([*new, "lr_scheduler"]))
                raise OptimizerError(f"optimizer {self.name!r} has no hyperparameter {key!r}{hint} (it takes: {takes})")
            if key == "clip_gradient" and value is None:
                value = -1.0
            if isinstance(new[key], bool) and not isinstance(value, bool):
                raise OptimizerError(f"{self.name}: {key} must be True or False, got {value!r}")
            if not isinstance(new[key], bool) and not _is_number(value):
                raise OptimizerError(f"{self.name}: {key} must be a finite number, got {value!r}")
            new[key] = value if isinstance(value, bool) else float(value)
        for name in ("learning_rate", "wd", "momentum", "epsilon", "lr_decay", "initial_accumulator_value"):  # (torch refuses them too)
            if new.get(name, 0.0) < 0:
                raise OptimizerError(f"{name} must be >= 0, got {new[name]}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= new.get(name, 0.0) < 1.0:
                raise OptimizerError(f"{name} must be in [0, 1), got {new[name]}")
        if new.get("nesterov") and (new["momentum"] <= 0 or new["dampening"] != 0):
            raise OptimizerError("nesterov needs momentum > 0 and dampening == 0 (as torch.optim.SGD)")
        self._hyper = new

    def describe(self) -> dict[str, Any]:
        """The JSON-able description (what travels): ``{"name", "hyper", "lr_scheduler"}``, copies."""
        sched = None if self._schedule is None else dict(self._schedule)
        return {"name": self.name, "hyper": dict(self._hyper), "lr_scheduler": sched}

    @classmethod
    def from_description(cls, desc: Mapping[str, Any]) -> Optimizer:
        """Rebuild from :meth:`describe`'s output; anything malformed is an ``OptimizerError``."""
        if not isinstance(desc, Mapping) or set(desc) - {"name", "hyper", "lr_scheduler"}:
            raise OptimizerError(f"not an optimizer description: {desc!r:.200}")
        hyper = desc.get("hyper", {})
        if not isinstance(hyper, Mapping):
            raise OptimizerError(f"optimizer hyper must be a dict, got {hyper!r:.200}")
        return cls(desc.get("name"), hyper, desc.get("lr_scheduler"))  # type: ignore[arg-type]

    def __repr__(self) -> str:
        changed = [f"{k}={v}" for k, v in self._hyper.items() if v != self._defaults[k]]
        sched = f", lr_scheduler={self._schedule}" if self._schedule else ""
        return f"pskv.optim.create({', '.join([repr(self.name), *changed])}{sched})"

    @property
    def learning_rate(self) -> float:
        """The learning rate the next update uses (schedule applied)."""
        return self._lr(self.num_update + 1)

    def set_learning_rate(self, lr: float) -> None:
        """Set the base learning rate (a schedule, if any, is applied on top of it)."""
        self._set({"learning_rate": lr})

    @property
    def rescale_grad(self) -> float:
        return float(self._hyper["rescale_grad"])

    def set_rescale_grad(self, scale: float) -> None:
        """Set the factor every gradient is multiplied by (the Trainer sets ``1 / batch_size``)."""
        self._set({"rescale_grad": scale})

    def _lr(self, num_update: int) -> float:
        return scheduled_lr(float(self._hyper["learning_rate"]), self._schedule, num_update)

    def _key_state(self, key: int, weight: Tensor) -> KeyState:
        """``key``'s state (a new one shaped like ``weight``), its update counted."""
        st = self.states.get(key)
        if st is not None and any(t.numel() != weight.numel() for t in st.tensors.values()):  # (torch's fused kernels do not check)
            raise OptimizerError(f"key {key}: its optimizer state is not the size of its value {tuple(weight.shape)} (states loaded for another key?)")
        if st is None:
            fills = self._rule.state(self._hyper)
            st = self.states[key] = KeyState(0, {n: torch.full_like(weight, v) for n, v in fills.items()})
        st.step += 1
        self.num_update = max(self.num_update, st.step)
        return st

    def update(self, key: int, grad: Tensor, weight: Tensor, grad_is_scratch: bool = False, rescale: Optional[float] = None) -> None:
        """Update ``weight`` of ``key`` in place, ``grad`` times ``rescale`` (None: ``rescale_grad``). ``grad`` is not
        modified unless ``grad_is_scratch`` (then the update works in it, else a dense gradient may be copied once)."""
        if grad.numel() != weight.numel() and not grad.is_sparse:  # (torch's fused SGD read past the gradient's end)
            raise OptimizerError(f"key {key}: a gradient of shape {tuple(grad.shape)} for a value of shape {tuple(weight.shape)}")
        st = self._key_state(key, weight)
        h, lr = self._hyper, self._lr(self.num_update)
        scale = float(h["rescale_grad"]) if rescale is None else rescale
        if grad.is_sparse:
            rows, vals = _rows(grad)
            self._rule.sparse(h, lr, st, rows, self._prepare(vals, scale), weight)
            return
        g = self._prepare(grad, scale, inplace=grad_is_scratch)  # a new tensor if rescaled or clipped
        if g is grad and not grad_is_scratch and self._rule.writes_grad(h):
            g = grad.clone()
        self._rule.dense(h, lr, st, g, weight)

    def update_all(self, keys: Sequence[int], grads: Sequence[Tensor], weights: Sequence[Tensor]) -> None:
        """:meth:`update` of many keys, the same numbers: dense sgd of tensors on one device in torch's fused
        kernel, a call per dtype (a few launches for every parameter, not a few per parameter)."""
        h = self._hyper
        one_device = all(not g.is_sparse and g.device == grads[0].device for g in grads)
        if not grads or self.name != "sgd" or h["clip_gradient"] > 0 or not one_device:
            for k, g, w in zip(keys, grads, weights):
                self.update(k, g, w)
            return
        states = [self._key_state(k, w) for k, w in zip(keys, weights)]
        gs = list(torch._foreach_mul(list(grads), float(h["rescale_grad"])))  # new tensors: grads untouched
        _sgd(h, self._lr(self.num_update), states, gs, list(weights))

    def _prepare(self, g: Tensor, scale: float, inplace: bool = False) -> Tensor:
        clip = self._hyper["clip_gradient"]
        if scale != 1.0:
            g = g.mul_(scale) if inplace else g * scale
        if clip > 0:
            g = g.clamp_(-clip, clip) if inplace else g.clamp(-clip, clip)
        return g

    def check_state(self, key: object, tensors: Mapping[str, Tensor], weight: Tensor) -> None:
        """Raise ``OptimizerError`` unless ``tensors`` are the states kept for ``weight`` (names, sizes)."""
        want = sorted(self._rule.state(self._hyper))
        if sorted(tensors) != want:
            hint = "load them into an optimizer with the same settings"
            raise OptimizerError(f"key {key}: the saved states are {sorted(tensors)} but {self!r} keeps {want}; {hint}")
        for n, t in tensors.items():
            if not isinstance(t, Tensor) or t.numel() != weight.numel():
                raise OptimizerError(f"key {key}: state {n!r} does not have the {weight.numel()} elements of the weight")

    def state_dict(self) -> dict[str, Any]:
        """States of every key: ``{"optimizer": description, "num_update", "keys": {key: {"step", "tensors"}}}``."""
        keys = {k: {"step": s.step, "tensors": dict(s.tensors)} for k, s in self.states.items()}
        return {"optimizer": self.describe(), "num_update": self.num_update, "keys": keys}

    def load_state_dict(self, state: Mapping[str, Any], weights: Optional[Mapping[int, Tensor]] = None) -> None:
        """Install (copies of) :meth:`state_dict`'s states on ``weights``' devices; a bad state changes nothing."""
        try:
            num_update = int(state["num_update"])
            new: dict[int, KeyState] = {}
            for k, s in state["keys"].items():
                weight = weights.get(int(k)) if weights is not None else None
                if weight is not None:
                    self.check_state(k, s["tensors"], weight)
                device = weight.device if weight is not None else None
                new[int(k)] = KeyState(int(s["step"]), {n: t.to(device, copy=True) for n, t in s["tensors"].items()})
        except OptimizerError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise OptimizerError(f"not a pskv optimizer state: {exc!r}") from exc
        self.states, self.num_update = new, num_update


STATE_FORMAT = "pskv-optimizer-states/1"


def save_states(path: Union[str, Path], state: Mapping[str, Any], key_names: Mapping[int, Any]) -> None:
    """``torch.save`` :meth:`Optimizer.state_dict`'s form and the user's name of each key to ``path``."""
    try:
        torch.save({**state, "format": STATE_FORMAT, "key_names": dict(key_names)}, str(path))
    except (OSError, RuntimeError) as exc:  # (torch says a missing folder as a RuntimeError)
        raise OptimizerError(f"cannot write optimizer states to {path}: {exc}") from exc


def load_states(path: Union[str, Path]) -> dict[str, Any]:
    """Read what :func:`save_states` wrote (``weights_only``: nothing in it is executed)."""
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except OSError as exc:
        raise OptimizerError(f"cannot read optimizer states from {path}: {exc.strerror or exc}") from exc
    except Exception as exc:  # not ours (they load with weights_only): torch's advice to load it unsafely does not apply
        raise OptimizerError(f"{path} is not a pskv optimizer-state file ({type(exc).__name__} from torch.load)") from exc
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise OptimizerError(f"{path} is not a pskv optimizer-state file")
    return state


def create(name: str, *, lr_scheduler: Optional[Mapping[str, Any]] = None, **hyper: Any) -> Optimizer:
    """Build an optimizer, e.g. ``create("sgd", learning_rate=0.1, momentum=0.9, lr_scheduler=...)``."""
    return Optimizer(name, hyper, lr_scheduler)


def updatable(dtype: torch.dtype, key: object) -> None:
    """Refuse an update of values an optimizer cannot update (torch's kernels fail deep inside)."""
    if not dtype.is_floating_point:
        raise OptimizerError(f"{key}: an optimizer updates floating-point values; these are {dtype}")


def apply_push(optimizer: Optional[Optimizer], key: int, merged: Tensor, stored: Tensor, merged_is_scratch: bool = False,
               rescale: Optional[float] = None) -> Optional[Tensor]:
    """What a store does with a key's merged push: ``optimizer.update`` (in place, inside ``merged``
    if it is scratch; ``rescale``: see there), or without one replace the stored value (a row-sparse push zeroes absent rows:
    the rows it brought, zero sums too, are returned, for a pull into a row-sparse out; else None)."""
    if optimizer is not None:
        optimizer.update(key, merged, stored, grad_is_scratch=merged_is_scratch, rescale=rescale)
    elif merged.is_sparse:
        write_rows(stored, *(rows := _rows(merged)))
        return rows[0]
    else:
        stored.copy_(merged)
    return None
