"""``state_dict`` / ``load_state_dict`` of the preconditioner (kfac_pytorch's format).

::

    {"steps": int,
     "factor_update_steps": ..., "inv_update_steps": ..., "damping": ..., "factor_decay": ...,
     "kl_clip": ..., "lr": ...,            # only those that are not callables
     "layers": {name: {"A": Tensor, "G": Tensor}}}   # only with include_factors=True

Inverses are not saved: they are recomputed from the loaded factors (``compute_inverses``).
A resumed run is bit-identical to an uninterrupted one when the decompositions in use at
the checkpoint were computed from the factors saved in it (e.g. ``inv_update_steps`` equal
to, or a divisor of, ``factor_update_steps`` and the checkpoint taken between steps).
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

from .layer import KFACLayer

__all__ = ["HYPERPARAMS", "layers_state", "load_layers_state"]

HYPERPARAMS = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")


def layers_state(layers: Sequence[KFACLayer]) -> Dict[str, Dict[str, Any]]:
    """``{name: {"A": A, "G": G}}`` (the tensors themselves, not copies)."""
    return {layer.name: layer.state_dict() for layer in layers}


def load_layers_state(layers: Sequence[KFACLayer], state: Mapping[str, Mapping[str, Any]]) -> None:
    """Load factors by layer name; the names must be exactly the registered ones."""
    by_name = {layer.name: layer for layer in layers}
    if set(state) != set(by_name):
        missing = sorted(set(by_name) - set(state))
        unexpected = sorted(set(state) - set(by_name))
        raise ValueError(f"K-FAC state_dict layers do not match the registered layers: "
                         f"missing {missing}, unexpected {unexpected}")
    for name, layer_state in state.items():
        by_name[name].load_state_dict(dict(layer_state))
