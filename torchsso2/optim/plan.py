"""The per-step bookkeeping of an optimizer update, built once and reused while nothing changes.

An update needs, for the parameters that have a gradient this step: each one's param group (lr,
momentum, weight decay are read from it at every step, so schedulers keep working), and the
curvature blocks of those parameters, with their positions in the list (a block with some parameters
absent, frozen or unused, preconditions the others with zeros in their place: :class:`PartialBlock`).
Rebuilding that with dictionaries at every step costs tens of µs on a small model (where a step
is mostly per-op overhead); :class:`PlanCache` rebuilds it only when the parameters, their groups
or the blocks change (compared by identity, so a swapped ``Parameter`` or a new block is seen).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from curvature.blocks import Block, DiagBlock
from curvature.stacklevel import caller_stacklevel

Group = Dict[str, Any]


@dataclass
class UpdatePlan:
    """``params[i]`` belongs to ``groups[i]``; ``blocks`` lists ``(block, positions)`` for every
    block with a covered parameter in ``params`` (``positions`` in the block's order; a block of which
    some parameters are absent, having no gradient, as a :class:`PartialBlock`);
    ``in_block[i]`` says whether ``params[i]`` is one of them; ``others`` lists the positions that are not."""

    params: List[nn.Parameter]
    groups: List[Group]
    blocks: List[Tuple[Block, List[int]]]
    in_block: List[bool]
    others: List[int] = field(init=False)  # derived from in_block

    def __post_init__(self) -> None:
        self.others = [i for i, inside in enumerate(self.in_block) if not inside]

    def precondition(self, vecs: Sequence[Tensor], solved: Optional[Dict[str, List[Tensor]]] = None) -> List[Tensor]:
        """``vecs`` with every block's entries replaced by ``block.solve`` of them (one process);
        ``solved`` gives the result of blocks already solved elsewhere, by block name."""
        out = list(vecs)
        for blk, pos in self.blocks:
            res = solved.get(blk.layout.name) if solved else None
            for i, s in zip(pos, res if res is not None else blk.solve([vecs[i] for i in pos])):
                out[i] = s
        return out

    def values(self, key: str) -> List[Any]:
        """``[groups[i][key] for i]``: a hyperparameter of every parameter, read now."""
        return [g[key] for g in self.groups]


class _PartialLayout:
    """The ``name`` and ``params`` of a :class:`PartialBlock` (those of its block that take part)."""

    def __init__(self, name: str, params: List[nn.Parameter]) -> None:
        self.name = name
        self.params = params


class PartialBlock:
    """A block of which only some covered parameters take part in this step; the others have no
    gradient (frozen with ``requires_grad_(False)`` after construction, or unused this step).

    ``solve`` preconditions ``[v | 0]`` — the absent parameters' entries zero — with the whole
    block (its curvature and decomposition are the block's own) and returns the entries of the
    parameters present; the absent ones are not updated. Everything else is the block's."""

    def __init__(self, block: Block, present: Sequence[int]) -> None:
        self.block = block
        self.present = list(present)
        every = block.layout.params
        self.layout = _PartialLayout(block.layout.name, [every[j] for j in self.present])

    def solve(self, vecs: Sequence[Tensor]) -> List[Tensor]:
        """``[(C + λI)⁻¹ [v | 0]]`` at the present parameters (``vecs`` in their order)."""
        every = self.block.layout.params
        like = vecs[0]
        full = [torch.zeros(p.shape, dtype=like.dtype, device=like.device) for p in every]
        for j, v in zip(self.present, vecs):
            full[j] = v
        out = self.block.solve(full)
        return [out[j] for j in self.present]

    def __getattr__(self, name: str) -> Any:  # decomposition, dim, ... of the block
        return getattr(self.__dict__["block"], name)


def warn_partly_frozen(opt: Any, plan: UpdatePlan) -> None:
    """Warn (once per block and optimizer) about a block of which some parameters were frozen
    (``requires_grad_(False)``) after the optimizer was built while others still train: the others get
    ``((C + λI)⁻¹)_PP g_P`` (:class:`PartialBlock`), not ``(C_PP + λI)⁻¹ g_P``, the natural gradient of
    the parameters that train with the frozen ones fixed, which an optimizer built after the freezing
    uses (2–20% apart on the K-FAC blocks measured, up to several-fold on full ones). A diagonal block gives
    the same either way.
    Looked at once per :class:`UpdatePlan` (a new one is built when the parameters with a gradient change)."""
    if plan.__dict__.get("partly_frozen_seen"):
        return
    plan.partly_frozen_seen = True  # type: ignore[attr-defined]
    warned = opt.__dict__.setdefault("_partly_frozen_warned", set())
    names = []
    for blk, _ in plan.blocks:
        if not isinstance(blk, PartialBlock) or isinstance(blk.block, DiagBlock) or blk.layout.name in warned:
            continue
        present = {id(q) for q in blk.layout.params}
        if any(not q.requires_grad for q in blk.block.layout.params if id(q) not in present):
            names.append(blk.layout.name)
    if names:
        warned.update(names)
        warnings.warn(
            f"blocks {names}: some of their parameters were frozen (requires_grad=False) after the optimizer was "
            "built and the others still train; those are preconditioned with the whole block's inverse, the frozen "
            "parameters' entries zero (((C + λI)⁻¹)_PP g_P), not with the inverse of their own part of it "
            "((C_PP + λI)⁻¹ g_P, the natural gradient with the frozen parameters fixed). An optimizer built after "
            "the freezing uses the latter: build a new one to get it", UserWarning, stacklevel=caller_stacklevel())


def build_plan(params: Sequence[nn.Parameter], groups: Sequence[Group], blocks: Dict[str, Block]) -> UpdatePlan:
    pos = {id(p): i for i, p in enumerate(params)}
    taken: List[Tuple[Any, List[int]]] = []
    in_block = [False] * len(params)
    for blk in blocks.values():
        ps = blk.layout.params
        present = [j for j, q in enumerate(ps) if id(q) in pos]
        if not present:
            continue
        view = blk if len(present) == len(ps) else PartialBlock(blk, present)
        idx = [pos[id(ps[j])] for j in present]
        taken.append((view, idx))
        for i in idx:
            in_block[i] = True
    return UpdatePlan(list(params), list(groups), taken, in_block)


class PlanCache:
    """Keeps the :class:`UpdatePlan` of the last call and returns it while its inputs are the same
    objects (parameters, their groups, the blocks and the blocks' parameters)."""

    def __init__(self) -> None:
        self._key: Optional[Tuple[Any, ...]] = None
        self._plan: Optional[UpdatePlan] = None

    def get(self, params: Sequence[nn.Parameter], groups: Sequence[Group], blocks: Dict[str, Block]) -> UpdatePlan:
        key = (tuple(map(id, params)), tuple(map(id, groups)), tuple(map(id, blocks.values())),
               tuple(id(q) for b in blocks.values() for q in b.layout.params))
        if self._plan is None or key != self._key:
            self._plan = build_plan(params, groups, blocks)
            self._key = key
        return self._plan


def params_with_grad(param_groups: Sequence[Group]) -> Tuple[List[nn.Parameter], List[Group]]:
    """The parameters that have a gradient and train (``requires_grad``), in param-group order, and the group of
    each. A frozen parameter's zero gradient, left by ``zero_grad(set_to_none=False)``, does not count: solved
    with its block, a zero there still moved it (through the block's coupling), as a frozen one must not."""
    params: List[nn.Parameter] = []
    groups: List[Group] = []
    for g in param_groups:
        for p in g["params"]:
            if p.grad is not None and p.requires_grad:
                params.append(p)
                groups.append(g)
    return params, groups


class ScalarCache:
    """0-dim tensors of hyperparameter values, kept per (value, dtype, device).

    ``torch._foreach_mul_(tensors, x)`` takes 8 µs with a Python float ``x`` and 2.7 µs with a
    0-dim tensor on CPU (4 tensors of the digits MLP): the scalar is wrapped into a tensor for every
    tensor of the list. Building the 0-dim tensor each time costs that back, so it is cached (a few
    entries: the momentum values of the param groups). Keyed by the tensors' dtype and device."""

    def __init__(self) -> None:
        self._cache: Dict[Tuple[float, torch.dtype, torch.device], Tensor] = {}

    def get(self, value: float, like: Tensor) -> Union[Tensor, float]:
        """``value`` as a cached 0-dim tensor for ``like``'s dtype and device; the Python float
        itself for other than float32/float64 tensors (a 0-dim factor changes the rounding of
        half-precision foreach kernels)."""
        if like.dtype not in (torch.float32, torch.float64):
            return value
        key = (value, like.dtype, like.device)
        t = self._cache.get(key)
        if t is None:
            if len(self._cache) > 64:  # a schedule of many values: keep the cache small
                self._cache.clear()
            t = self._cache[key] = torch.tensor(value, dtype=like.dtype, device=like.device)
        return t
