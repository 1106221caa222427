"""KAISA work placement: who decomposes which factor, who preconditions which gradient.

Following KAISA (Pauloski et al., SC'21, https://arxiv.org/abs/2107.01739) and the
semantics of kfac_pytorch's ``KAISAAssignment``, with our own code.

The world of ``W`` ranks is cut into ``W / g`` *gradient-worker groups* of ``g`` ranks,
``g = max(1, round(W * grad_worker_fraction))``; here they are contiguous blocks::

    W = 8, g = 2         grad-worker groups (contiguous): (0 1) (2 3) (4 5) (6 7)
                         receiver groups (strided):        (0 2 4 6) (1 3 5 7)

Every layer is placed on one grad-worker group: each of its factors is decomposed by one
*inverse worker* in that group; the inverses are broadcast to the rest of the group (only
needed when ``g > 1``); every grad worker of the layer preconditions the gradient; each
grad worker then broadcasts the preconditioned gradient to its *receiver group*, the ranks
at the same offset in the other grad-worker groups (only needed when ``g < W``). Receiver
groups meet every grad-worker group in exactly one rank, so every rank gets its gradient
from exactly one source, :meth:`WorkAssignment.src_grad_worker`.

Placement is the greedy "longest processing time first" rule: layers (or factors) in
descending cost, each to the least-loaded eligible rank; ties go to the lowest rank. It
guarantees ``max load <= total / W + largest layer cost``.

Note: kfac_pytorch lays the grid out the other way round (strided grad-worker groups,
contiguous receiver groups). Which is better depends on the network: contiguous
grad-worker groups keep the per-layer inverse broadcasts inside a node, strided ones keep
the per-step gradient broadcasts inside a node. Results are identical either way.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from enum import Enum
from typing import Type, TypeVar, Union

from curvature.options import a_or_an, did_you_mean, float_or_inf


E = TypeVar("E", bound=Enum)


def parse_enum(value: Union[E, str], enum: Type[E], arg: str) -> E:
    """``value`` as a member of ``enum``; a string is a case-insensitive member name.

    Raises:
        ValueError: unknown name (the message names the value and the choices).
        TypeError: neither a member nor a string.
    """
    if isinstance(value, enum):
        return value
    choices = ", ".join(m.name for m in enum)
    if isinstance(value, str):
        try:
            return enum[value.strip().upper()]
        except KeyError:
            hint = did_you_mean(value, [m.name.lower() for m in enum])
            raise ValueError(f"{arg}={value!r} is not valid{hint}; expected one of {choices} "
                             f"({a_or_an(enum.__name__)} {enum.__name__} or its name)") from None
    raise TypeError(f"{arg} must be {a_or_an(enum.__name__)} {enum.__name__} or a string, got {type(value).__name__} "
                    f"{value!r}")



class AssignmentStrategy(Enum):
    """Cost model used to balance inverse work: decomposition time or memory of the result."""

    COMPUTE = 1
    MEMORY = 2

    def cost(self, n: int) -> float:
        """Cost of one ``[n, n]`` factor under this model (see :func:`compute_cost`)."""
        return compute_cost(n) if self is AssignmentStrategy.COMPUTE else memory_cost(n)


class DistributedStrategy(Enum):
    """Named gradient-worker fractions of KAISA.

    * ``COMM_OPT``: fraction 1, every rank is a grad worker; no gradient broadcast.
    * ``MEM_OPT``: fraction ``1 / world_size``, one grad worker per layer; no inverse
      broadcast.
    * ``HYBRID_OPT``: fraction 0.5.
    """

    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3

    def fraction(self, world_size: int) -> float:
        """The grad-worker fraction this strategy stands for in a world of ``world_size``."""
        if self is DistributedStrategy.COMM_OPT:
            return 1.0
        if self is DistributedStrategy.MEM_OPT:
            return 1.0 / world_size
        return 0.5


def compute_cost(n: int) -> float:
    """Decomposition time model of an ``[n, n]`` factor: ``n ** 3`` (eigh, Cholesky, inverse)."""
    return float(n) ** 3


def memory_cost(n: int) -> float:
    """Memory model of a decomposed ``[n, n]`` factor: ``n ** 2`` elements."""
    return float(n) ** 2


def grad_worker_count(world_size: int, grad_worker_fraction: float | DistributedStrategy | str) -> int:
    """Number ``g`` of grad workers per layer, validated as KAISA requires.

    ``g = max(1, round(world_size * fraction))``; ``world_size * fraction`` must be an
    integer when it is at least 1, and ``world_size`` must be a multiple of ``g``.

    Raises:
        ValueError: ``world_size < 1``, fraction outside ``(0, 1]``, or a non-integer or
            non-dividing worker count (the message names the values).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(grad_worker_fraction, str):  # "comm_opt", as the optimizers take it
        grad_worker_fraction = parse_enum(grad_worker_fraction, DistributedStrategy, "grad_worker_fraction")
    if isinstance(grad_worker_fraction, DistributedStrategy):
        fraction = grad_worker_fraction.fraction(world_size)
    elif isinstance(grad_worker_fraction, bool) or not isinstance(grad_worker_fraction, numbers.Real):
        raise TypeError(f"grad_worker_fraction must be a float in (0, 1], a DistributedStrategy or its name "
                        f"('comm_opt', 'mem_opt', 'hybrid_opt'), got {type(grad_worker_fraction).__name__} "
                        f"{grad_worker_fraction!r}")
    else:
        fraction = float_or_inf(grad_worker_fraction)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"grad_worker_fraction must be in (0, 1], got {grad_worker_fraction!r}")
    raw = world_size * fraction
    count = max(1, round(raw))
    if raw >= 1 and not math.isclose(raw, count, rel_tol=0, abs_tol=1e-6):
        raise ValueError(
            f"world_size * grad_worker_fraction must be an integer: {world_size} * {fraction} = {raw}"
            + (f" (grad_worker_fraction {grad_worker_fraction.name} is {fraction} at {world_size} ranks; it needs an "
               "even world size)" if isinstance(grad_worker_fraction, DistributedStrategy) else
               f"; use a world size that is a multiple of 1/{fraction:g} = {1 / fraction:g}, or a fraction k/{world_size} "
               f"(k dividing {world_size}; e.g. {1 / world_size:g} or 1.0)"))
    if world_size % count != 0:
        raise ValueError(
            f"world_size {world_size} must be a multiple of the grad-worker count {count} "
            f"(grad_worker_fraction={grad_worker_fraction!r})"
        )
    return count


def partition_grad_workers(world_size: int, grad_workers: int) -> list[tuple[int, ...]]:
    """Contiguous grad-worker groups: ``[(0..g-1), (g..2g-1), ...]``, ``world_size / g`` of them."""
    return [tuple(range(start, start + grad_workers)) for start in range(0, world_size, grad_workers)]


def partition_grad_receivers(world_size: int, grad_workers: int) -> list[tuple[int, ...]]:
    """Strided receiver groups: ``[(0, g, 2g, ...), (1, g+1, ...), ...]``, ``g`` of them."""
    return [tuple(range(offset, world_size, grad_workers)) for offset in range(grad_workers)]


def _argmin(loads: list[float], candidates: tuple[int, ...]) -> int:
    """Least-loaded rank among ``candidates``; ties go to the lowest rank."""
    return min(candidates, key=lambda r: (loads[r], r))


def greedy_assignment(
    work: Mapping[str, Mapping[str, float]],
    worker_groups: list[tuple[int, ...]],
    world_size: int,
    colocate_factors: bool,
) -> tuple[dict[str, dict[str, int]], list[float]]:
    """Longest-processing-time-first placement of factor work on ranks.

    Layers are taken by descending total cost (ties by name). With ``colocate_factors``
    a layer goes whole to the least-loaded rank of the world (its group follows from the
    rank). Otherwise the layer goes to the least-loaded group (by summed load) and its
    factors, by descending cost, each to the least-loaded rank of that group.

    Returns:
        ``(assignment, loads)``: layer -> factor -> rank, and the summed cost per rank.
    """
    loads = [0.0] * world_size
    everyone = tuple(range(world_size))
    totals = {layer: float(sum(factors.values())) for layer, factors in work.items()}
    order = sorted(work, key=lambda layer: (-totals[layer], layer))
    assignment: dict[str, dict[str, int]] = {}
    for layer in order:
        if colocate_factors:
            rank = _argmin(loads, everyone)
            loads[rank] += totals[layer]
            assignment[layer] = {factor: rank for factor in work[layer]}
            continue
        group = min(worker_groups, key=lambda g: (sum(loads[r] for r in g), g[0]))
        placed: dict[str, int] = {}
        for factor, cost in sorted(work[layer].items(), key=lambda item: (-item[1], item[0])):
            rank = _argmin(loads, group)
            loads[rank] += float(cost)
            placed[factor] = rank
        assignment[layer] = {factor: placed[factor] for factor in work[layer]}
    return assignment, loads


def _validate_work(work: Mapping[str, Mapping[str, float]]) -> None:
    for layer, factors in work.items():
        if not factors:
            raise ValueError(f"layer {layer!r} has no factors; expected e.g. {{'A': cost, 'G': cost}}")
        for factor, cost in factors.items():
            if not math.isfinite(float(cost)) or cost < 0:
                raise ValueError(f"cost of layer {layer!r} factor {factor!r} must be finite and >= 0, got {cost!r}")


class WorkAssignment:
    """KAISA placement of inverse work and gradient workers (see the module docstring).

    Pure bookkeeping: no communication happens here. Every rank builds the same object
    from the same arguments; the optimizer turns :meth:`communication_groups` into
    ``comm.new_group`` calls (same order on every rank).

    Args:
        work: layer name -> {factor name (``"A"``, ``"G"`` or ``"block"``): cost}, costs
            in the unit of ``strategy`` (see :meth:`from_sizes` to build them from sizes).
        world_size: number of ranks.
        grad_worker_fraction: fraction of ranks that precondition each layer's gradient,
            in ``(0, 1]``, or a :class:`DistributedStrategy`.
        strategy: the cost model the costs come from (recorded, shown by :meth:`summary`).
        colocate_factors: decompose all factors of a layer on one rank; ``False`` spreads
            them over the layer's grad-worker group (with one grad worker per layer, e.g.
            ``MEM_OPT``, that group is one rank: the factors are colocated whatever the flag says).
    """

    def __init__(
        self,
        work: Mapping[str, Mapping[str, float]],
        world_size: int,
        grad_worker_fraction: float | DistributedStrategy,
        strategy: AssignmentStrategy = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
    ) -> None:
        if not isinstance(strategy, AssignmentStrategy):
            raise ValueError(f"strategy must be an AssignmentStrategy, got {strategy!r}")
        _validate_work(work)
        self.world_size = world_size
        self.grad_workers_per_layer = grad_worker_count(world_size, grad_worker_fraction)
        self.grad_worker_fraction = self.grad_workers_per_layer / world_size
        self.strategy = strategy
        # with one grad worker per layer its group is that one rank: the factors are colocated whatever
        # the flag says (kfac_pytorch's KAISAAssignment places them so too, e.g. HYBRID_OPT on 2 ranks)
        self.colocate_factors = colocate_factors or self.grad_workers_per_layer == 1
        self.work = {layer: dict(factors) for layer, factors in work.items()}
        g = self.grad_workers_per_layer
        self.grad_worker_groups = partition_grad_workers(world_size, g)
        self.grad_receiver_groups = partition_grad_receivers(world_size, g)
        self._inv, self.loads = greedy_assignment(self.work, self.grad_worker_groups, world_size, colocate_factors)
        self._layer_group = {layer: self.grad_worker_groups[next(iter(f.values())) // g] for layer, f in self._inv.items()}

    @classmethod
    def from_sizes(
        cls,
        sizes: Mapping[str, Mapping[str, int]],
        world_size: int,
        grad_worker_fraction: float | DistributedStrategy,
        strategy: AssignmentStrategy = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
    ) -> WorkAssignment:
        """Build from factor dimensions (layer -> factor -> ``n`` of its ``[n, n]`` matrix)."""
        work = {layer: {f: strategy.cost(n) for f, n in factors.items()} for layer, factors in sizes.items()}
        return cls(work, world_size, grad_worker_fraction, strategy, colocate_factors)

    # -- queries ----------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[str, ...]:
        """Layer names, in the order of ``work``."""
        return tuple(self.work)

    def factors(self, layer: str) -> tuple[str, ...]:
        """Factor names of ``layer``."""
        return tuple(self._lookup(layer))

    def inv_worker(self, layer: str, factor: str) -> int:
        """Rank that decomposes ``factor`` of ``layer``."""
        factors = self._lookup(layer)
        if factor not in factors:
            raise KeyError(f"layer {layer!r} has no factor {factor!r}; it has {list(factors)}")
        return factors[factor]

    def inv_workers(self, layer: str) -> dict[str, int]:
        """Factor -> rank that decomposes it, for ``layer``."""
        return dict(self._lookup(layer))

    def grad_workers(self, layer: str) -> list[int]:
        """Ranks that precondition the gradient of ``layer`` (its grad-worker group)."""
        self._lookup(layer)
        return list(self._layer_group[layer])

    def is_grad_worker(self, rank: int, layer: str) -> bool:
        """Whether ``rank`` preconditions the gradient of ``layer``."""
        self._check_rank(rank)
        return rank in self.grad_workers(layer)

    def src_grad_worker(self, rank: int, layer: str) -> int:
        """Rank that sends ``rank`` the preconditioned gradient of ``layer`` (itself if a grad worker)."""
        self._check_rank(rank)
        return self.grad_workers(layer)[rank % self.grad_workers_per_layer]

    def grad_receivers(self, layer: str) -> dict[int, list[int]]:
        """Gradient broadcasts of ``layer``: grad worker -> ranks of its receiver group.

        Each grad worker ``src`` broadcasts its preconditioned gradient over the listed
        ranks (``src`` included); the lists partition the world.
        """
        workers = self.grad_workers(layer)
        return {src: list(self.grad_receiver_groups[i]) for i, src in enumerate(workers)}

    def broadcast_gradients(self) -> bool:
        """Whether preconditioned gradients must be broadcast (fewer grad workers than ranks)."""
        return self.grad_workers_per_layer < self.world_size

    def broadcast_inverses(self) -> bool:
        """Whether inverses must be broadcast (more than one grad worker per layer)."""
        return self.grad_workers_per_layer > 1

    def communication_groups(self) -> list[tuple[int, ...]]:
        """Every group the broadcasts use, in a fixed order (for ``comm.new_group``).

        Grad-worker groups first (inverse broadcasts, if needed), then receiver groups
        (gradient broadcasts, if needed); groups of one rank are left out.
        """
        groups: list[tuple[int, ...]] = []
        if self.broadcast_inverses():
            groups += self.grad_worker_groups
        if self.broadcast_gradients():
            groups += [g for g in self.grad_receiver_groups if g not in groups]
        return [g for g in groups if len(g) > 1]

    def rank_load(self, rank: int) -> float:
        """Summed cost of the factors ``rank`` decomposes."""
        self._check_rank(rank)
        return self.loads[rank]

    def summary(self) -> str:
        """Human-readable table: layer -> inverse workers and grad workers; per-rank load."""
        unit = "n^3" if self.strategy is AssignmentStrategy.COMPUTE else "n^2"
        lines = [
            f"WorkAssignment: world_size={self.world_size}, grad workers/layer={self.grad_workers_per_layer} "
            f"(fraction {self.grad_worker_fraction:g}), strategy={self.strategy.name} ({unit}), "
            f"colocate_factors={self.colocate_factors}",
            f"broadcast inverses: {self.broadcast_inverses()}, broadcast gradients: {self.broadcast_gradients()}",
        ]
        name_w = max([5] + [len(layer) for layer in self.work])
        lines.append(f"{'layer':<{name_w}}  {'cost':>12}  {'inverse workers':<28}  grad workers")
        for layer in self.layers:
            invs = ", ".join(f"{f}->{r}" for f, r in self._inv[layer].items())
            cost = sum(self.work[layer].values())
            lines.append(f"{layer:<{name_w}}  {cost:>12.4g}  {invs:<28}  {list(self._layer_group[layer])}")
        total = sum(self.loads)
        lines.append("rank  load          share")
        for rank, load in enumerate(self.loads):
            share = load / total if total > 0 else 0.0
            lines.append(f"{rank:<4}  {load:<12.4g}  {share:6.1%}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"WorkAssignment(layers={len(self.work)}, world_size={self.world_size}, "
            f"grad_workers_per_layer={self.grad_workers_per_layer}, strategy={self.strategy.name})"
        )

    # -- helpers ----------------------------------------------------------------------------
    def _lookup(self, layer: str) -> dict[str, int]:
        try:
            return self._inv[layer]
        except KeyError:
            raise KeyError(f"unknown layer {layer!r}; known layers: {list(self.work)}") from None

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
