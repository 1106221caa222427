"""``seed=None``: one draw of torch's global generator at construction. It was ``torch.initial_seed()``,
which every optimizer built after one ``torch.manual_seed`` shared: an ensemble's members drew the same
weight noise and Monte-Carlo labels."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer

FACES = {"second_order": lambda m: SecondOrderOptimizer(m), "vi": lambda m: VIOptimizer(m, dataset_size=100)}


@pytest.mark.parametrize("face", list(FACES))
def test_unseeded_optimizers_get_different_streams_repeatably(face: str) -> None:
    def build_three():
        torch.manual_seed(0)
        return [FACES[face](nn.Linear(4, 3)) for _ in range(3)]
    first, again = build_three(), build_three()
    seeds = [opt.seed for opt in first]
    assert len(set(seeds)) == 3  # different streams
    assert seeds == [opt.seed for opt in again]  # repeatable under torch.manual_seed
    draws = [torch.rand(4, generator=opt.generator) for opt in first]
    assert not torch.equal(draws[0], draws[1])


def test_an_explicit_seed_takes_nothing_from_the_global_generator() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    state = torch.random.get_rng_state()
    VIOptimizer(model, dataset_size=100, seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
