"""What one message carries: one tensor, or several that cross a cut together (a bundle).

A model cut where several values cross it (a U-Net's skip connections, a detector's feature
maps, a hidden state and its mask) hands on a *bundle*: a tuple of tensors, or a flat dict
``str -> tensor``. Every member travels in the same message, each as its own handle (or its
own bytes frame), under one header (tensormq/wire.py, ``xs`` and ``keys``). A block whose
input is a tuple takes its members as positional arguments, a dict as keyword arguments
(``call``): that is how ``blockflow export`` writes the blocks of a cut crossed by several
tensors (blocks/split.py).

A single tensor is never a bundle: it keeps the one-descriptor header (``x``) and its fast
path through every hop. A tuple of one tensor is a bundle of one (its receiver gets a tuple).
"""
from __future__ import annotations

import re

import torch

#: Most tensors one message may carry (the header lists a descriptor for each).
MAX_MEMBERS = 16
#: What a dict member's name may be: it is also a keyword argument of the next block.
KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")


def is_bundle(value) -> bool:
    return isinstance(value, (tuple, list, dict))


def flatten(value, what: str = "value") -> tuple[list[torch.Tensor], list[str] | None]:
    """``(members, keys)`` of a tuple/list (keys None) or a flat dict of tensors; a TypeError
    or ValueError names what is wrong (a member that is not a tensor, too many, a bad key)."""
    if isinstance(value, dict):
        keys = list(value)
        for k in keys:
            if not isinstance(k, str) or not KEY_RE.fullmatch(k):
                raise ValueError(f"{what}: dict key {str(k)!r:.70} must be a name of at most 64 letters, "
                                 "digits, '_', '.' or '-' (not starting with a digit)")
        members = list(value.values())
    elif isinstance(value, (tuple, list)):
        keys, members = None, list(value)
    else:
        raise TypeError(f"{what} must be a tensor, a tuple of tensors or a dict of tensors, "
                        f"got {type(value).__name__}")
    if not 1 <= len(members) <= MAX_MEMBERS:
        raise ValueError(f"{what} has {len(members)} tensors; a message carries 1 to {MAX_MEMBERS}")
    for i, t in enumerate(members):
        if not isinstance(t, torch.Tensor):
            name = f"[{keys[i]!r}]" if keys else f"[{i}]"
            raise TypeError(f"{what}{name} is a {type(t).__name__}, not a tensor (nested values cannot travel)")
    return members, keys


def assemble(members: list, keys: list[str] | None):
    """The bundle ``flatten`` took apart: a dict when there are keys, else a tuple."""
    return dict(zip(keys, members)) if keys is not None else tuple(members)


def apply(fn, value):
    """``fn`` on a tensor, or on every member of a bundle (same structure back)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    members, keys = flatten(value)
    return assemble([fn(t) for t in members], keys)


def call(model, value):
    """Run ``model`` on a tensor, on a tuple's members as positional arguments, or on a
    dict's as keyword arguments."""
    if isinstance(value, torch.Tensor):
        return model(value)
    if isinstance(value, dict):
        return model(**value)
    return model(*value)


def first(value) -> torch.Tensor:
    """The tensor, or a bundle's first member (what a KPI row's batch column reads)."""
    if isinstance(value, torch.Tensor):
        return value
    return next(iter(value.values())) if isinstance(value, dict) else value[0]
