"""Where a block's parameters live: the module, its family, the covered parameter names/shapes."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..modules.base import LayerFamily


@dataclass(frozen=True)
class TiedUse:
    """Another module using one of a layout's parameters (tied weights, e.g. ``head.weight = emb.weight``):
    the module ``name``/``module`` of family ``family`` holds it as ``param``; the layout's module as
    ``owner_param``."""

    name: str
    module: nn.Module
    family: LayerFamily
    param: str
    owner_param: str


def parameter_gone(name: str, module: nn.Module, param: str) -> ValueError:
    """The error for a covered parameter ``param`` that module ``name`` no longer holds as a parameter:
    a reparametrization applied after the optimizer was built (``torch.nn.utils.parametrize``'s
    ``weight_norm`` / ``spectral_norm`` / ``orthogonal`` move the weight to
    ``parametrizations.weight.original``; ``torch.nn.utils.prune`` to ``weight_orig``), or the
    attribute deleted or set to None. The curvature would precondition a computed tensor that no optimizer
    updates."""
    moved = sorted(n for n, p in module._parameters.items() if n.startswith(param) and p is not None)
    where = f" (its parameters are now {moved})" if moved else ""
    if param in module._parameters and module._parameters[param] is None:
        where = " (it is None now)"
    if nn.utils.parametrize.is_parametrized(module, param):
        where = f" (torch.nn.utils.parametrize moved it to 'parametrizations.{param}.original')"
    qualified = f"module {name!r}" if name else "the model itself"
    return ValueError(
        f"{qualified} ({type(module).__name__}) no longer holds its parameter {param!r} as a parameter{where}: a "
        "reparametrization (torch.nn.utils.parametrizations.weight_norm / spectral_norm / orthogonal, "
        "torch.nn.utils.prune, the old weight_norm / spectral_norm) or a deletion (or `module."
        f"{param} = None`) after the optimizer was built. "
        "The covered modules and their parameters are fixed when it is built, and its curvature formulas do not "
        "describe a computed weight: build the optimizer after reparametrizing, with the module in skip_modules "
        "(skip_layers for KFACPreconditioner), or remove the reparametrization (e.g. torch.nn.utils.prune.remove)")


def held_parameters(name: str, module: nn.Module, param_names: Sequence[str]) -> List[nn.Parameter]:
    """``module``'s parameters ``param_names``, read from its parameter dict (``nn.Module.__getattr__`` costs
    ~0.5 µs a name; a swapped Parameter is seen); :func:`parameter_gone`'s ValueError for one it no longer holds."""
    own = module._parameters
    try:
        held = [own[n] for n in param_names]
    except KeyError as err:
        raise parameter_gone(name, module, err.args[0]) from None
    for n, p in zip(param_names, held):  # `module.bias = None` keeps the name with no parameter (not `None in
        if p is None:                     # held`: that compares tensors with ==, 35 µs a block)
            raise parameter_gone(name, module, n)
    return held  # type: ignore[return-value]


@dataclass
class Layout:
    """The covered parameters of one module, in ``named_parameters`` order.

    ``flatten`` / ``unflatten`` convert between a list of parameter-shaped tensors and the
    flat ``[P]`` vector ordered like ``torch.cat([p.flatten() for p in params])``.
    """

    name: str
    module: nn.Module
    family: LayerFamily
    param_names: Tuple[str, ...]
    shapes: Tuple[torch.Size, ...] = field(default=())
    #: other modules using some of these parameters (tied weights); their contributions are summed in
    tied: Tuple[TiedUse, ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.shapes:
            mods = dict(self.module.named_parameters(recurse=False))
            self.shapes = tuple(mods[n].shape for n in self.param_names)
        # (shape, contiguous strides, offset) of each parameter inside the flat vector, for unflatten
        offsets, i = [], 0
        for shape in self.shapes:
            offsets.append(i)
            i += int(math.prod(shape))
        self._views = tuple((tuple(s), torch.empty(s, device="meta").stride(), o)
                            for s, o in zip(self.shapes, offsets))

    @property
    def params(self) -> List[nn.Parameter]:
        # looked up each time, so a swapped Parameter is seen (covered names are direct parameters)
        return held_parameters(self.name, self.module, self.param_names)

    @property
    def numel(self) -> int:
        return int(sum(math.prod(s) for s in self.shapes))

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """List of parameter-shaped tensors -> ``[P]``."""
        return torch.cat([t.reshape(-1) for t in tensors])

    def unflatten(self, flat: Tensor) -> List[Tensor]:
        """``[P]`` -> list of parameter-shaped tensors (views of ``flat``).

        A contiguous ``flat`` is cut with one ``as_strided`` per parameter (4 µs for two
        parameters; slicing and reshaping took 11, ``split`` + ``view`` 14: this runs several
        times a step in VI and diagonal solves)."""
        if flat.dim() == 1 and flat.stride(0) == 1:
            base = flat.storage_offset()
            return [flat.as_strided(shape, stride, base + off) for shape, stride, off in self._views]
        out, i = [], 0
        for s in self.shapes:
            k = int(math.prod(s))
            out.append(flat[i:i + k].reshape(s))
            i += k
        return out

    def matrix_perm(self) -> Tensor:
        """``perm[j]`` = flat parameter index of entry ``j`` of row-major ``vec(M)`` (K-FAC layout)."""
        idx = torch.arange(self.numel, dtype=torch.float64)
        parts = self.unflatten(idx)
        m = self.family.to_matrix(self.module, parts, self.param_names)
        return m.reshape(-1).round().long()


def kfac_dims(layout: Layout) -> Tuple[int, int]:
    """``(r, c)``: the shape of the layer's parameter matrix ``M`` (K-FAC's left factor is ``r × r``
    or a diagonal ``[r]``, the right one ``c × c`` or ``[c]``), from the layout's parameter shapes: the
    family's column split of ``M``, its ``matrix_shape``, or a single matrix parameter as it is (no tensor at all:
    an op on meta tensors imports ``torch._dynamo``, a second's import); otherwise ``to_matrix`` of meta tensors."""
    spans = layout.family.matrix_columns(layout.module, layout.param_names)
    if spans:
        cols = max(stop for _, stop in spans)
        return layout.numel // cols, cols
    shape = layout.family.matrix_shape(layout.module, layout.param_names)
    if shape is not None:  # a matrix that permutes its parameters (a transposed convolution's)
        return shape
    if len(layout.shapes) == 1 and len(layout.shapes[0]) == 2:  # an Embedding's [V, D] weight is M
        return int(layout.shapes[0][0]), int(layout.shapes[0][1])
    zeros = [torch.zeros(s, device="meta") for s in layout.shapes]
    try:
        m = layout.family.to_matrix(layout.module, zeros, layout.param_names)
    except (RuntimeError, NotImplementedError):  # a family that cannot run on meta tensors
        m = layout.family.to_matrix(layout.module, [torch.zeros(s) for s in layout.shapes], layout.param_names)
    return int(m.shape[0]), int(m.shape[1])


def kfac_left_is_diagonal(layout: Layout) -> bool:
    """Whether K-FAC's left factor of ``layout`` is stored as a diagonal ``[r]`` (every use's family stores it
    so, as Embedding's token counts; a tied use of another family makes the summed factor dense)."""
    return all(fam.kfac_diagonal_left for fam in [layout.family] + [u.family for u in layout.tied])


def kfac_dense_sides(layout: Layout) -> List[int]:
    """The sizes of K-FAC's dense (matrix) factors of ``layout``: ``[r, c]`` of :func:`kfac_dims`, without a
    diagonal left factor."""
    r, c = kfac_dims(layout)
    return [c] if kfac_left_is_diagonal(layout) else [r, c]
