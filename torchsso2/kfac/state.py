"""``state_dict`` / ``load_state_dict`` of the preconditioner: kfac_pytorch's format plus decompositions.

::

    {"steps": int,
     "factor_update_steps": ..., "inv_update_steps": ..., "damping": ..., "factor_decay": ...,
     "kl_clip": ..., "lr": ...,                        # only those that are not callables
     "layers": {name: {"A": Tensor, "G": Tensor}},     # include_factors=True
     "torchsso2": {                                     # include_decompositions=True
         "decompositions": {name: {key: Tensor}},      #   with include_factors=True
         "inv_ready": [name, ...],                     #   the layers decomposed so far (idem)
         "placement": {"world_size": int,              #   where they were held: the saving world,
                       "grad_workers": {name: [rank, ...]},   # each layer's grad workers and
                       "decomposition": [method, prediv]},    # the method (idem)
         "num_skipped": int, "consecutive_skips": int}}  # the non-finite policy's counters

Everything but ``"torchsso2"`` is kfac_pytorch's format (``include_decompositions=False`` gives
exactly its keys; kfac_pytorch ignores the extra key when it loads ours; ours loads its).
``decompositions`` holds, for each layer this rank is a grad worker of, the tensors it
preconditions with (:meth:`KFACLayer.decomposition_shapes`: ``qa``, ``qg``,
``dgda`` / ``qa``, ``da``, ``qg``, ``dg`` / ``a_inv``, ``g_inv``), so a resumed run is bit-identical
to an uninterrupted one whatever the cadence (with ``inv_update_steps`` not a multiple of
``factor_update_steps`` the decompositions in use are older than the saved factors and
cannot be recomputed from them). A state dict without ``decompositions`` (kfac_pytorch's, or
``include_decompositions=False``) has them recomputed from the factors (``compute_inverses``).
So are the decompositions of a layer whose grad workers differ from ``placement``'s (another world
size or strategy, elastic training): its new grad workers may load different ranks' files, some
with the decomposition and some without, and would precondition with different ones.

:func:`validate_state` checks the whole state dict against the registered layers before
anything is changed and returns it staged (tensors already copied to the layers' devices);
the preconditioner then applies it, which cannot fail.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor

from .hyperparams import check_schedule
from .layer import KFACLayer

__all__ = ["EXTENSION", "HYPERPARAMS", "StagedState", "decompositions_state", "layers_state", "validate_state"]

HYPERPARAMS = ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr")
EXTENSION = "torchsso2"
COUNTERS = ("num_skipped", "consecutive_skips")
KEYS = ("steps",) + HYPERPARAMS + ("layers", EXTENSION)
EXTENSION_KEYS = ("decompositions", "inv_ready", "placement") + COUNTERS


def layers_state(layers: Sequence[KFACLayer]) -> Dict[str, Dict[str, Any]]:
    """``{name: {"A": A, "G": G}}`` (the tensors themselves, not copies)."""
    return {layer.name: layer.state_dict() for layer in layers}


def decompositions_state(layers: Sequence[KFACLayer]) -> Tuple[Dict[str, Dict[str, Tensor]], List[str]]:
    """``({name: {key: tensor}}, inv_ready names)``: the decompositions of the layers this rank
    holds completely (the tensors themselves), and the names of the layers decomposed so far."""
    held = {}
    for layer in layers:
        keys = layer.decomposition_shapes()
        if layer.inv_ready and all(k in layer.inv for k in keys):
            held[layer.name] = {k: layer.inv[k] for k in keys}
    return held, [layer.name for layer in layers if layer.inv_ready]


@dataclass
class StagedState:
    """A validated state dict, ready to apply (tensors are copies on the layers' devices).

    ``factors`` is ``None`` when the state dict has no ``layers``; ``decompositions`` is
    ``None`` when it has none (kfac_pytorch's format: recompute them).
    """

    steps: int
    hyperparams: Dict[str, Any]
    factors: Optional[Dict[str, Tuple[Optional[Tensor], Optional[Tensor]]]]
    decompositions: Optional[Dict[str, Dict[str, Tensor]]]
    inv_ready: Set[str] = field(default_factory=set)
    counters: Dict[str, int] = field(default_factory=dict)
    #: ``(world_size, {name: grad-worker ranks})`` of the saving world (None: not recorded)
    placement: Optional[Tuple[int, Dict[str, Tuple[int, ...]]]] = None


def _fail(entry: str, problem: str) -> ValueError:
    return ValueError(f"KFACPreconditioner.load_state_dict: state_dict{entry} {problem}; the preconditioner "
                      "was left unchanged")


def _int(entry: str, value: Any, minimum: int) -> int:
    if isinstance(value, Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise _fail(entry, f"must be an int >= {minimum}, got {type(value).__name__} {value!r}")
    return int(value)


def _tensor(entry: str, value: Any, shape: Tuple[int, ...], device: torch.device,
            dtype: Optional[torch.dtype], convert: bool) -> Tensor:
    """Check one tensor (type, shape, dtype, finiteness) and return a copy on ``device``."""
    if not isinstance(value, Tensor):
        raise _fail(entry, f"must be a tensor of shape {shape}, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise _fail(entry, f"has shape {tuple(value.shape)}, the registered layer needs {shape}")
    if not value.is_floating_point():
        raise _fail(entry, f"has dtype {value.dtype}, expected a floating dtype")
    if dtype is not None and value.dtype != dtype and not convert:
        raise _fail(entry, f"has dtype {value.dtype}, the preconditioner stores {dtype} (inv_dtype); "
                           "construct it with the same inv_dtype or drop 'decompositions' to recompute them")
    if not bool(torch.isfinite(value).all()):
        raise _fail(entry, "holds NaN/inf values")
    return value.detach().to(device=device, dtype=dtype if dtype is not None else value.dtype, copy=True)


def validate_state(state: Any, layers: Sequence[KFACLayer], factor_dtype: Optional[torch.dtype],
                   inv_dtype: torch.dtype) -> StagedState:
    """Check every entry of ``state`` against the registered ``layers``; raise ``ValueError`` naming
    the first bad entry (nothing is changed by this function).

    Checked: it is a dict with ``steps`` and only known keys; ``steps`` and the counters are
    ints >= 0; the hyper-parameters pass the constructor's checks; ``layers`` names exactly the
    registered layers, each with exactly ``A`` and ``G``, ``None`` or a finite floating tensor
    of the layer's shape (``[n_A, n_A]``, ``[n_G, n_G]``); ``decompositions`` names registered
    layers, each with exactly the keys and shapes of :meth:`KFACLayer.decomposition_shapes`, in
    ``inv_dtype``, finite; ``inv_ready`` names registered layers, and each ready layer has
    decompositions or factors to compute them from.
    """
    if not isinstance(state, Mapping):
        raise TypeError(f"KFACPreconditioner.load_state_dict: state_dict must be a dict from "
                         f"KFACPreconditioner.state_dict(), got {type(state).__name__}")
    if "steps" not in state:
        raise _fail("", "has no 'steps' key (it must come from KFACPreconditioner.state_dict())")
    unknown = sorted(str(k) for k in state if k not in KEYS)
    if unknown:
        raise _fail("", f"has unexpected keys {unknown} (known: {list(KEYS)})")
    steps = _int("['steps']", state["steps"], 0)
    hyper = {}
    for name in HYPERPARAMS:
        if name in state:
            try:
                check_schedule(name, state[name])
            except (TypeError, ValueError) as exc:
                raise _fail(f"[{name!r}]", f"is invalid: {exc}") from None
            hyper[name] = state[name]
    ext = state.get(EXTENSION, {})
    if not isinstance(ext, Mapping):
        raise _fail(f"[{EXTENSION!r}]", f"must be a dict, got {type(ext).__name__}")
    unknown = sorted(str(k) for k in ext if k not in EXTENSION_KEYS)
    if unknown:
        raise _fail(f"[{EXTENSION!r}]", f"has unexpected keys {unknown} (known: {list(EXTENSION_KEYS)})")
    where = f"[{EXTENSION!r}]"
    counters = {name: _int(f"{where}[{name!r}]", ext[name], 0) for name in COUNTERS if name in ext}
    by_name = {layer.name: layer for layer in layers}

    def names_of(entry: str, value: Any, exact: bool) -> None:
        if not isinstance(value, Mapping):
            raise _fail(entry, f"must be a dict keyed by layer name, got {type(value).__name__}")
        missing = sorted(set(by_name) - set(value)) if exact else []
        unexpected = sorted(str(n) for n in set(value) - set(by_name))
        if missing or unexpected:
            raise _fail(entry, f"does not match the registered layers {sorted(by_name)}: missing {missing}, "
                               f"unexpected {unexpected}")

    factors = None
    if "layers" in state:
        names_of("['layers']", state["layers"], exact=True)
        factors = {}
        for name, layer_state in state["layers"].items():
            layer = by_name[name]
            entry = f"['layers'][{name!r}]"
            if not isinstance(layer_state, Mapping) or set(layer_state) != {"A", "G"}:
                keys = sorted(layer_state) if isinstance(layer_state, Mapping) else type(layer_state).__name__
                raise _fail(entry, f"must have exactly the keys 'A' and 'G', got {keys}")
            device = layer.params[0].device
            pair = []
            for key in ("A", "G"):
                n = layer.sizes[key]
                t = layer_state[key]
                pair.append(None if t is None else _tensor(f"{entry}[{key!r}]", t, (n, n), device,
                                                           factor_dtype, convert=True))
            factors[name] = (pair[0], pair[1])

    # first: a decomposition method other than the saved one is the same error on every rank
    placement = _placement(f"{where}['placement']", ext["placement"], by_name) if "placement" in ext else None
    decompositions = None
    ready: Set[str] = set()
    if "decompositions" in ext or "inv_ready" in ext:
        if "decompositions" not in ext or "inv_ready" not in ext:
            raise _fail(where, "must have both 'decompositions' and 'inv_ready' or neither")
        if factors is None:
            raise _fail(f"{where}['decompositions']", "needs the factors ('layers') next to it")
        names_of(f"{where}['decompositions']", ext["decompositions"], exact=False)
        ready_list = ext["inv_ready"]
        if not isinstance(ready_list, (list, tuple)) or any(n not in by_name for n in ready_list):
            raise _fail(f"{where}['inv_ready']", f"must be a list of registered layer names {sorted(by_name)}, "
                                                 f"got {ready_list!r}")
        ready = set(ready_list)
        decompositions = {}
        for name, tensors in ext["decompositions"].items():
            layer = by_name[name]
            entry = f"{where}['decompositions'][{name!r}]"
            shapes = layer.decomposition_shapes()
            if name not in ready:
                raise _fail(entry, "is given for a layer not listed in 'inv_ready'")
            if not isinstance(tensors, Mapping) or set(tensors) != set(shapes):
                keys = sorted(tensors) if isinstance(tensors, Mapping) else type(tensors).__name__
                raise _fail(entry, f"must have exactly the keys {sorted(shapes)} (compute_method="
                                   f"{layer.method.name}, prediv={layer.prediv}), got {keys}")
            device = layer.params[0].device
            decompositions[name] = {k: _tensor(f"{entry}[{k!r}]", tensors[k], shape, device, inv_dtype,
                                               convert=False) for k, shape in shapes.items()}
        for name in sorted(ready - set(decompositions)):
            if factors[name][0] is None or factors[name][1] is None:
                raise _fail(f"{where}['inv_ready']", f"lists {name!r}, which has neither decompositions nor factors")
    if placement is not None and factors is not None:  # (a moved layer is decomposed from its factors)
        missing = sorted(n for n in ready if factors[n][0] is None or factors[n][1] is None)
        if missing:
            raise _fail(f"{where}['inv_ready']", f"lists {missing}, whose factors are missing")
    return StagedState(steps, hyper, factors, decompositions, ready, counters, placement)


def _placement(entry: str, value: Any, by_name: Mapping[str, KFACLayer]) -> Tuple[int, Dict[str, Tuple[int, ...]]]:
    """``{"world_size": W, "grad_workers": {name: [ranks]}, "decomposition": [method, prediv]}`` checked and
    returned as ``(W, {name: ranks})``. A ``decomposition`` other than this preconditioner's
    (``compute_method``, ``compute_eigenvalue_outer_product``) is an error on every rank, also on one whose
    file holds no decompositions (each rank saves it)."""
    keys = {"world_size", "grad_workers", "decomposition"}
    if not isinstance(value, Mapping) or set(value) != keys:
        raise _fail(entry, f"must be a dict with the keys {sorted(keys)}, got {value!r}")
    mine = next(iter(by_name.values()), None)
    saved = value["decomposition"]
    if mine is not None and list(saved) != mine.decomposition_kind:
        raise _fail(f"{entry}['decomposition']", f"is {list(saved)} (compute_method, eigenvalue outer product), this "
                    f"preconditioner uses {mine.decomposition_kind}: construct it with the saved "
                    "compute_method and compute_eigenvalue_outer_product, or drop the 'torchsso2' entry to "
                    "decompose the saved factors anew")
    world = _int(f"{entry}['world_size']", value["world_size"], 1)
    workers = value["grad_workers"]
    if not isinstance(workers, Mapping) or any(n not in by_name for n in workers):
        raise _fail(f"{entry}['grad_workers']", f"must map registered layer names {sorted(by_name)} to rank lists")
    out: Dict[str, Tuple[int, ...]] = {}
    for name, ranks in workers.items():
        if not isinstance(ranks, (list, tuple)) or not all(
                isinstance(r, numbers.Integral) and not isinstance(r, bool) and 0 <= r < world for r in ranks):
            raise _fail(f"{entry}['grad_workers'][{name!r}]", f"must be a list of ranks in [0, {world}), got {ranks!r}")
        out[name] = tuple(int(r) for r in ranks)
    return world, out
