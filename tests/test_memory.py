"""Memory over many steps (issue #28 item 1): every face × curvature kind keeps the number of
live tensors and the resident memory flat — in particular ``curvature="empirical_fisher"``
with the ordinary closure, whose output-gradient hook once held the tensor it was registered
on (a reference cycle through autograd that Python cannot collect: every step's activations
stayed alive)."""
from __future__ import annotations

import gc
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner

STEPS = 500
WARMUP = 20

#: (face, curvature kind, pass targets=y to step)
GRID = [(face, kind, targets)
        for face in ("sso", "vi")
        for kind, targets in (("fisher", False), ("fisher_mc", False), ("empirical_fisher", False),
                              ("empirical_fisher", True), ("hessian", True))] + [("kfac", "empirical_fisher", False)]


def live_tensors() -> int:
    """Number of torch tensors the garbage collector tracks (after a full collection)."""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``)."""
    with open("/proc/self/statm") as f:
        import os
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _stepper(face: str, kind: str, targets: bool):
    torch.manual_seed(0)
    # wide enough that one step's leaked activations (~100 KB) show in the RSS, small enough to be fast;
    # the Hessian's diagonal costs a backward per parameter: a narrower model there
    d, width = (8, 8) if kind == "hessian" else (64, 128)
    model = nn.Sequential(nn.Linear(d, width), nn.Tanh(), nn.Linear(width, 10))
    x, y = torch.randn(64, d), torch.randint(0, 10, (64,))
    if face == "kfac":
        pre = KFACPreconditioner(model, lr=0.01, damping=0.01)
        sgd = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            sgd.zero_grad()
            F.cross_entropy(model(x), y).backward()
            pre.step()
            sgd.step()
        step.optimizer = None  # type: ignore[attr-defined]
        return step
    if face == "sso":
        # the default shape (K-FAC) for the Fisher kinds; K-FAC of the Hessian does not exist: diag
        opt = SecondOrderOptimizer(model, lr=0.01, curvature=kind, seed=0,
                                   damping=10.0 if kind == "hessian" else 0.1,  # H has negative entries
                                   approx="diag" if kind == "hessian" else None)
    else:
        opt = VIOptimizer(model, dataset_size=1000, lr=0.01, curvature=kind, prior_precision=1.0,
                          damping=100.0 if kind == "hessian" else 0.0, seed=0)  # N·H has negative entries

    def closure():
        opt.zero_grad()
        out = model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        return loss, out

    def step() -> None:
        opt.step(closure, targets=y if targets else None)
    step.optimizer = opt  # type: ignore[attr-defined]
    return step


@pytest.mark.parametrize("face,kind,targets", GRID, ids=[f"{f}-{k}-{'targets' if t else 'closure'}" for f, k, t in GRID])
def test_live_tensors_and_rss_flat_over_many_steps(face, kind, targets):
    step = _stepper(face, kind, targets)
    for _ in range(WARMUP):
        step()
    tensors0, rss0 = live_tensors(), rss_bytes()
    for _ in range(STEPS - WARMUP):
        step()
    tensors1, rss1 = live_tensors(), rss_bytes()
    # every step did its work (a skipped step logs its exception, which a log handler may keep alive)
    assert step.optimizer is None or step.optimizer.num_skipped == 0
    assert tensors1 == tensors0, f"{tensors1 - tensors0} tensors left alive over {STEPS - WARMUP} steps"
    # a leak of one step's activations is ~100 KB a step, ~48 MB over the run; the allocator's noise is far below
    assert rss1 - rss0 < 8 * 2 ** 20, f"RSS grew by {(rss1 - rss0) / 2 ** 20:.1f} MiB over {STEPS - WARMUP} steps"


@pytest.mark.parametrize("face,kind,targets", GRID, ids=[f"{f}-{k}-{'targets' if t else 'closure'}" for f, k, t in GRID])
def test_a_step_leaves_no_cyclic_garbage(face, kind, targets):
    """Everything a step allocates is freed by reference counting when the step ends: garbage in
    reference cycles waits for the cyclic collector (for the oldest generation, until ~25% more
    long-lived objects exist), holding the batch's activations and fresh statistics meanwhile —
    RSS then grows for thousands of steps before it is collected."""
    step = _stepper(face, kind, targets)
    for _ in range(3):
        step()
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            step()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        # torch's own pytree helpers (vmap, in the exact Fisher and the Hessian) are recursive closures:
        # cycles of a few small functions, holding no tensors; counted here: tensors and this library's objects
        ours = [o for o in gc.garbage if isinstance(o, torch.Tensor)
                or type(o).__module__.split(".")[0] in ("curvature", "torchsso2")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert not ours, f"{len(ours)} tensors/library objects in reference cycles after 5 steps: " \
        f"{sorted({type(o).__name__ for o in ours})}"
