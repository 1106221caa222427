"""``copy.deepcopy`` of the faces (optimizers, KFACPreconditioner): one process only, and a field-by-field
copy that leaves out what the copy must not share (hooks on the original's modules, a scheduler's wrapper)."""
from __future__ import annotations

import copy
from typing import Any, Callable, Dict, TypeVar

T = TypeVar("T")


def copy_fields(obj: T, memo: Dict[int, Any], owner: str, fresh: str, name: str,
                left_out: Callable[[str], bool]) -> T:
    """A new ``type(obj)`` whose ``__dict__`` entries are deep copies of ``obj``'s, except the keys
    ``left_out`` (the caller sets those); registered in ``memo`` first, so references back to ``obj``
    inside the copied fields point at the copy.

    ``TypeError`` when ``obj.comm`` spans several processes (a communicator cannot be copied), naming
    ``owner`` ("an optimizer"), what to build instead (``fresh``) and the variable of its
    ``state_dict()`` (``name``)."""
    if obj.comm.world_size > 1:  # type: ignore[attr-defined]
        raise TypeError(f"copy.deepcopy of {owner} that communicates over several processes is not supported (its "
                        f"communicator cannot be copied); build {fresh} and load_state_dict({name}.state_dict()) "
                        "instead")
    new = type(obj).__new__(type(obj))
    memo[id(obj)] = new
    for key, value in obj.__dict__.items():
        if not left_out(key):
            new.__dict__[key] = copy.deepcopy(value, memo)
    return new
