"""The use check's window bounds (curvature/uses.py) are read from autograd's sequence counter.

A window must hold exactly the nodes created during a module call: its first node (the use of the
weight itself) and its last one; a node created before the call or after it must fall outside. The
bounds are read without creating probe nodes, so the check adds nothing to the forward's graph. The
decisions equal those of the probe-node bounds (the fall-back for a torch without the counter).
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvature.uses as uses
from curvature.capture import Capture
from curvature.uses import UseWindows


class MLP(nn.Module):
    """Linear → ReLU → Linear as a custom module (a plain nn.Sequential skips the check)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Tied(nn.Module):
    """``lin`` then (optionally) a functional use of ``lin.weight`` outside its call."""

    def __init__(self, functional_use: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.functional_use = functional_use

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        return F.linear(h, self.lin.weight) if self.functional_use else h * 2.0


def _check(model: nn.Module, x: torch.Tensor, counter: Optional[object]) -> Optional[str]:
    """Run the bare use windows (no recording hooks around the call) and return the error, if any."""
    old = uses._next_sequence_nr
    uses._next_sequence_nr = counter
    try:
        windows = UseWindows({"lin": model.lin})
        handles = windows.attach()
        try:
            out = model(x)
        finally:
            for h in handles:
                h.remove()
        try:
            windows.check(out)
        except ValueError as e:
            return str(e)
        return None
    finally:
        uses._next_sequence_nr = old


@pytest.mark.parametrize("counter", ["torch", None], ids=["counter", "probe"])
def test_the_first_and_last_node_of_a_call_are_inside_its_window(counter: object) -> None:
    # Linear's forward is one node (addmm) that uses the weight: it is both the first and the last node
    # of the call, with no recording hook after it: a window one number too narrow on either side raises
    model = Tied(functional_use=False)
    c = uses._next_sequence_nr if counter == "torch" else None
    assert _check(model, torch.randn(4, 3), c) is None


@pytest.mark.parametrize("counter", ["torch", None], ids=["counter", "probe"])
def test_a_use_right_after_the_call_is_outside_its_window(counter: object) -> None:
    model = Tied(functional_use=True)
    c = uses._next_sequence_nr if counter == "torch" else None
    err = _check(model, torch.randn(4, 3), c)
    assert err is not None and "lin.weight" in err


def test_a_use_right_before_the_call_is_outside_its_window() -> None:
    class Before(Tied):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.linear(x, self.lin.weight)  # the node created just before the call opens
            return self.lin(x)

    assert _check(Before(False), torch.randn(4, 3), uses._next_sequence_nr) is not None
    assert _check(Before(False), torch.randn(4, 3), None) is not None


def test_the_check_adds_no_nodes_to_the_forward() -> None:
    # probe bounds created two autograd nodes per covered call (sequence numbers used up, and an
    # allocation each); the counter creates none: a forward under the check uses as many numbers as without
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(6, 4)
    modules = {"a": model.a, "b": model.b}

    def numbers_used(check_uses: bool) -> int:
        start = torch.autograd._get_sequence_nr()
        with Capture(modules, root=model, check_uses=check_uses):
            model(x)
        return torch.autograd._get_sequence_nr() - start

    assert numbers_used(True) == numbers_used(False)


def test_capture_with_the_check_records_the_same_tensors() -> None:
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(6, 4)
    modules = {"a": model.a, "b": model.b}
    assert Capture(modules, root=model, check_uses=True)._uses is not None
    with Capture(modules, root=model, check_uses=True, record_backward=True) as a:
        model(x).square().sum().backward()
    with Capture(modules, root=model, check_uses=False, record_backward=True) as b:
        model(x).square().sum().backward()
    for name in modules:
        torch.testing.assert_close(a.records[name].output, b.records[name].output, rtol=0, atol=0)
        torch.testing.assert_close(a.records[name].backward_grads, b.records[name].backward_grads, rtol=0, atol=0)
