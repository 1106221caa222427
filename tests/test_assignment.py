"""KAISA work placement: invariants over many configurations, strategies, errors, summary.

The real-process check that a WorkAssignment drives the broadcasts correctly lives in
tests/test_distributed_comm.py::test_kaisa_communication_flow.
"""

from __future__ import annotations

import random

import pytest

from torchsso2.distributed import (
    AssignmentStrategy,
    DistributedStrategy,
    WorkAssignment,
    compute_cost,
    memory_cost,
)
from torchsso2.distributed.assignment import (
    grad_worker_count,
    partition_grad_receivers,
    partition_grad_workers,
)


def random_work(seed: int, layers: int = 12, kfac: bool = True) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    work: dict[str, dict[str, float]] = {}
    for i in range(layers):
        if kfac or i % 3:
            work[f"layer{i}"] = {"A": compute_cost(rng.randint(1, 64)), "G": compute_cost(rng.randint(1, 64))}
        else:
            work[f"layer{i}"] = {"block": compute_cost(rng.randint(1, 64))}
    return work


CONFIGS = [
    (world, fraction, colocate)
    for world in (1, 2, 4, 8)
    for fraction in (DistributedStrategy.COMM_OPT, DistributedStrategy.HYBRID_OPT, DistributedStrategy.MEM_OPT, 0.25)
    for colocate in (True, False)
]


def _valid(world: int, fraction: float | DistributedStrategy, colocate: bool) -> bool:
    try:
        WorkAssignment({"x": {"A": 1.0}}, world, fraction, colocate_factors=colocate)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("world,fraction,colocate", [c for c in CONFIGS if _valid(*c)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_invariants(world: int, fraction: float | DistributedStrategy, colocate: bool, seed: int) -> None:
    work = random_work(seed, kfac=colocate or seed != 2)
    wa = WorkAssignment(work, world, fraction, colocate_factors=colocate)
    g = wa.grad_workers_per_layer
    assert world % g == 0

    # the two partitions cover the world; every receiver group meets every worker group once
    assert sorted(r for grp in wa.grad_worker_groups for r in grp) == list(range(world))
    assert sorted(r for grp in wa.grad_receiver_groups for r in grp) == list(range(world))
    for wg in wa.grad_worker_groups:
        assert len(wg) == g and list(wg) == list(range(wg[0], wg[0] + g))  # contiguous
        for rg in wa.grad_receiver_groups:
            assert len(set(wg) & set(rg)) == 1

    for layer in work:
        workers = wa.grad_workers(layer)
        assert len(workers) == g and tuple(workers) in wa.grad_worker_groups
        for factor in work[layer]:
            assert wa.inv_worker(layer, factor) in workers  # inverse worker inside its group
        if colocate:
            assert len(set(wa.inv_workers(layer).values())) == 1
        receivers = wa.grad_receivers(layer)
        assert sorted(receivers) == workers
        assert sorted(r for ranks in receivers.values() for r in ranks) == list(range(world))
        for rank in range(world):
            src = wa.src_grad_worker(rank, layer)
            assert wa.is_grad_worker(src, layer)
            assert rank in receivers[src]
            assert wa.is_grad_worker(rank, layer) == (rank in workers)
            if wa.is_grad_worker(rank, layer):
                assert src == rank

    # greedy (LPT) bound: max load <= mean load + largest layer cost
    total = sum(sum(f.values()) for f in work.values())
    largest = max(sum(f.values()) for f in work.values())
    assert sum(wa.loads) == pytest.approx(total)
    assert max(wa.loads) <= total / world + largest + 1e-9
    assert wa.loads == [wa.rank_load(r) for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_named_strategies(world: int) -> None:
    work = random_work(3)
    comm_opt = WorkAssignment(work, world, DistributedStrategy.COMM_OPT)
    assert comm_opt.grad_workers_per_layer == world
    assert all(comm_opt.is_grad_worker(r, layer) for r in range(world) for layer in work)
    assert not comm_opt.broadcast_gradients()
    assert comm_opt.broadcast_inverses() == (world > 1)

    mem_opt = WorkAssignment(work, world, DistributedStrategy.MEM_OPT)
    assert mem_opt.grad_workers_per_layer == 1
    for layer in work:
        assert mem_opt.grad_workers(layer) == [mem_opt.inv_worker(layer, "A")]
    assert not mem_opt.broadcast_inverses()
    assert mem_opt.broadcast_gradients() == (world > 1)

    hybrid = WorkAssignment(work, world, DistributedStrategy.HYBRID_OPT)
    assert hybrid.grad_workers_per_layer == max(1, world // 2)
    assert WorkAssignment(work, world, 0.5).grad_workers_per_layer == hybrid.grad_workers_per_layer


def test_partitions_match_the_documented_grid() -> None:
    assert partition_grad_workers(8, 2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert partition_grad_receivers(8, 2) == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert grad_worker_count(8, DistributedStrategy.MEM_OPT) == 1
    assert grad_worker_count(6, 1 / 3) == 2  # float rounding of 6 * (1/3) is tolerated


def test_greedy_places_largest_first_on_least_loaded() -> None:
    work = {"big": {"A": 10.0}, "mid": {"A": 6.0}, "small1": {"A": 5.0}, "small2": {"A": 1.0}}
    wa = WorkAssignment(work, 2, DistributedStrategy.MEM_OPT)
    assert wa.inv_worker("big", "A") == 0
    assert wa.inv_worker("mid", "A") == 1
    assert wa.inv_worker("small1", "A") == 1
    assert wa.inv_worker("small2", "A") == 0
    assert wa.loads == [11.0, 11.0]


def test_factors_spread_within_group_when_not_colocated() -> None:
    work = {"l": {"A": 8.0, "G": 8.0}}
    wa = WorkAssignment(work, 4, 0.5, colocate_factors=False)
    a, g = wa.inv_worker("l", "A"), wa.inv_worker("l", "G")
    assert a != g and {a, g} == set(wa.grad_workers("l"))


@pytest.mark.parametrize("world,fraction", [(2, DistributedStrategy.HYBRID_OPT), (4, DistributedStrategy.MEM_OPT),
                                            (4, 0.25)])
def test_one_grad_worker_per_layer_colocates_whatever_the_flag(world: int, fraction) -> None:
    # kfac_pytorch accepts colocate_factors=False there (HYBRID_OPT on 2 ranks): the group is one rank
    work = random_work(3)
    spread = WorkAssignment(work, world, fraction, colocate_factors=False)
    together = WorkAssignment(work, world, fraction, colocate_factors=True)
    assert spread.colocate_factors
    for layer in work:
        assert spread.inv_workers(layer) == together.inv_workers(layer)
        assert len(set(spread.inv_workers(layer).values())) == 1


def test_communication_groups_cover_what_broadcasts_need() -> None:
    wa = WorkAssignment(random_work(0), 8, 0.5)
    groups = wa.communication_groups()
    assert groups == [(0, 1, 2, 3), (4, 5, 6, 7), (0, 4), (1, 5), (2, 6), (3, 7)]
    assert WorkAssignment(random_work(0), 4, DistributedStrategy.COMM_OPT).communication_groups() == [(0, 1, 2, 3)]
    assert WorkAssignment(random_work(0), 4, DistributedStrategy.MEM_OPT).communication_groups() == [(0, 1, 2, 3)]
    assert WorkAssignment(random_work(0), 1, DistributedStrategy.COMM_OPT).communication_groups() == []


def test_cost_models_and_from_sizes() -> None:
    assert compute_cost(4) == 64.0 and memory_cost(4) == 16.0
    assert AssignmentStrategy.COMPUTE.cost(3) == 27.0 and AssignmentStrategy.MEMORY.cost(3) == 9.0
    wa = WorkAssignment.from_sizes({"l": {"A": 3, "G": 2}}, 1, 1.0, strategy=AssignmentStrategy.MEMORY)
    assert wa.work == {"l": {"A": 9.0, "G": 4.0}} and wa.loads == [13.0]


@pytest.mark.parametrize("fraction", [0, 0.0, -0.5, 1.5, 2])
def test_fraction_outside_unit_interval(fraction: float) -> None:
    with pytest.raises(ValueError, match=f"got {fraction!r}"):
        WorkAssignment({"l": {"A": 1.0}}, 4, fraction)


def test_configuration_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match="multiple of the grad-worker count 3"):
        WorkAssignment({"l": {"A": 1.0}}, 4, 0.75)
    with pytest.raises(ValueError, match=r"6 \* 0.25 = 1.5"):
        WorkAssignment({"l": {"A": 1.0}}, 6, 0.25)
    with pytest.raises(ValueError, match="world_size must be a positive int, got 0"):
        WorkAssignment({"l": {"A": 1.0}}, 0, 1.0)
    with pytest.raises(ValueError, match="'l'.*no factors"):
        WorkAssignment({"l": {}}, 2, 1.0)
    with pytest.raises(ValueError, match="'l'.*'A'.*-1"):
        WorkAssignment({"l": {"A": -1.0}}, 2, 1.0)
    wa = WorkAssignment({"l": {"A": 1.0}}, 2, 1.0)
    with pytest.raises(KeyError, match="'nope'"):
        wa.grad_workers("nope")
    with pytest.raises(KeyError, match="'G'"):
        wa.inv_worker("l", "G")
    with pytest.raises(ValueError, match="rank 2"):
        wa.is_grad_worker(2, "l")
    # one rank: everything is trivially valid, also without colocation
    assert WorkAssignment({"l": {"A": 1.0, "G": 1.0}}, 1, DistributedStrategy.MEM_OPT,
                          colocate_factors=False).inv_workers("l") == {"A": 0, "G": 0}


def test_summary_lists_layers_workers_and_loads() -> None:
    wa = WorkAssignment(random_work(1, layers=3), 4, DistributedStrategy.HYBRID_OPT)
    text = wa.summary()
    for layer in wa.layers:
        assert layer in text
    for rank in range(4):
        assert f"\n{rank}    " in text
    assert "grad workers/layer=2" in text and "COMPUTE" in text
    assert "broadcast inverses: True, broadcast gradients: True" in text


@pytest.mark.parametrize(
    "world, fraction",
    [(6, 0.3333333333), (9, 0.3333333333), (12, 0.3333333333), (8, 0.5), (3, 1 / 3), (4, 0.2500000001)],
)
def test_grad_worker_count_rounds_a_product_within_tolerance(world: int, fraction: float) -> None:
    """world * fraction within 1e-6 of an integer is accepted and rounded to it, not truncated
    (6 * 0.3333333333 = 1.9999999998 -> 2 workers, not 1). Reference: round(world * fraction), which
    must also divide world (the documented contract)."""
    want = max(1, round(world * fraction))
    assert abs(world * fraction - want) < 1e-6 and world % want == 0  # the premise: a legal input
    assert grad_worker_count(world, fraction) == want


def test_hybrid_opt_at_an_odd_world_size_names_the_strategy() -> None:
    from torchsso2.distributed.assignment import DistributedStrategy, grad_worker_count
    with pytest.raises(ValueError, match="HYBRID_OPT is 0.5 at 3 ranks; it needs an even world size"):
        grad_worker_count(3, DistributedStrategy.HYBRID_OPT)
    assert grad_worker_count(4, DistributedStrategy.HYBRID_OPT) == 2


def test_the_fraction_by_name_and_a_bad_type_are_clear() -> None:
    """The optimizers take grad_worker_fraction="comm_opt": so does WorkAssignment (it raised float()'s
    "could not convert string to float")."""
    work = {"x": {"A": 1.0}}
    for name, strategy in (("comm_opt", DistributedStrategy.COMM_OPT), ("Mem_Opt", DistributedStrategy.MEM_OPT),
                           ("hybrid_opt", DistributedStrategy.HYBRID_OPT)):
        assert (WorkAssignment(work, 4, name).grad_workers_per_layer
                == WorkAssignment(work, 4, strategy).grad_workers_per_layer)
    with pytest.raises(ValueError, match=r"grad_worker_fraction='bogus' is not valid; expected one of COMM_OPT"):
        WorkAssignment(work, 4, "bogus")
    with pytest.raises(TypeError, match=r"grad_worker_fraction must be a float in \(0, 1\].*got NoneType None"):
        WorkAssignment(work, 4, None)


def test_a_worker_count_that_is_not_an_integer_names_the_world_sizes_that_fit():
    with pytest.raises(ValueError, match=r"3 \* 0.5 = 1.5; use a world size that is a multiple of 1/0.5 = 2, or a "
                                         r"fraction k/3 \(k dividing 3; e.g. 0.333333 or 1.0\)"):
        grad_worker_count(3, 0.5)
