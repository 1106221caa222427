"""Covered modules that part of a step's batch does not go through (a mixture of experts routed per
example), in SecondOrderOptimizer / VIOptimizer with captured curvature (torchsso2/optim/routing.py).

The micro-batches of one closure and the ranks of a data-parallel step that did not call a module count
as zero blocks, K-FAC's ``A`` weighted by the rows each module saw: the result is one process on the
whole batch in one forward, exactly (float64), whichever ranks call which expert. Before, with several
processes it was a ValueError (the ranks' blocks were averaged by position).
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvature import CurvatureEngine
from curvature.options import Approx
from dist_utils import assert_replicas_equal_one_process, launch, mpiexec_command, torchrun_command
from models import Experts
from torchsso2 import SecondOrderOptimizer
from torchsso2.optim.routing import zero_block

WORKER = str(Path(__file__).parent / "dist_scripts" / "routed_native_worker.py")


class Zoo(nn.Module):
    """One layer of every family (an Embedding, a Conv2d, a LayerNorm, a BatchNorm, an attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.norm = nn.LayerNorm(4)
        self.bn = nn.BatchNorm1d(4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4 + 2 * 9, 3)

    def forward(self, tokens: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(tokens))
        h, _ = self.attn(h, h, h, need_weights=False)
        c = self.conv(image).flatten(1)
        return self.head(torch.cat([self.bn(h.mean(1)), c], 1))


@pytest.mark.parametrize("approx", ["kfac", "diag", "full"])
def test_zero_blocks_have_the_shapes_of_estimated_blocks(approx):
    """A rank that did not call a module averages a zero block built from the layout alone (before the
    module has a running block): its statistics have the estimated block's shapes, for every family."""
    torch.manual_seed(0)
    model = Zoo().double()
    wanted = {n: (Approx.DIAG if approx == "kfac" and isinstance(m, (nn.LayerNorm, nn.BatchNorm1d)) else Approx(approx))
              for n, m in model.named_children()}
    engine = CurvatureEngine(model, kind="fisher_mc", approx={n: a.value for n, a in wanted.items()})
    tokens, image = torch.randint(0, 7, (5, 3)), torch.randn(5, 1, 3, 3, dtype=torch.float64)
    with engine.capture() as cap:
        out = model(tokens, image)
    blocks = engine.estimate(cap, out)
    assert set(blocks) == set(wanted) | {"attn.out_proj"}
    for name, block in blocks.items():
        zero = zero_block(engine.layouts[name], engine.approx[name])
        assert type(zero) is type(block), name
        assert [t.shape for t in zero.tensors()] == [t.shape for t in block.tensors()], name
        assert all(t.dtype == torch.float64 and not t.any() for t in zero.tensors()), name


def _routed_batch():
    """16 rows whose first 8 route to no row of some expert that the last 8 use (Experts' gate)."""
    model = Experts(call_empty=False).double()
    for seed in range(100):
        x = torch.randn(16, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            pick = model.gate(x).argmax(1)
        first, second = set(pick[:8].tolist()), set(pick[8:].tolist())
        if second - first and first & second:
            return x, torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(seed))
    raise AssertionError("no seed routes as wanted")


@pytest.mark.parametrize("approx,kind", [("kfac", "empirical_fisher"), ("kfac", "fisher_mc"), ("diag", "hessian"),
                                         ("full", "hessian")])
def test_micro_batches_routed_differently_equal_one_forward(approx, kind):
    """Two micro-batches in one closure, an expert called in the second only (and one in both, on other
    row counts): the step's curvature equals one forward on the whole batch (the expert's block averaged
    with zeros from the first; K-FAC's A weighted by the rows). Before, the expert's block was that of the
    second micro-batch alone: twice its part of the batch."""
    x, y = _routed_batch()
    running = []
    for micro in (False, True):
        model = Experts(call_empty=False).double()
        opt = SecondOrderOptimizer(model, approx=approx, curvature=kind, lr=0.1, damping=1.0, seed=0)

        def closure():
            opt.zero_grad()
            parts = zip(x.chunk(2), y.chunk(2)) if micro else [(x, y)]
            for xs, ys in parts:
                out = model(xs)
                loss = F.cross_entropy(out, ys) * len(ys) / len(y)
                loss.backward()
            return loss, out
        opt.step(closure, targets=y if kind != "fisher_mc" else None)
        running.append({n: [t.clone() for t in b.tensors()] for n, b in opt.running.blocks.items()})
    assert set(running[0]) == set(running[1]) == {"gate", "experts.0", "experts.1", "experts.2"}
    if kind == "fisher_mc":
        return  # (its sampled labels differ between the two ways of running: it must run, and cover every expert)
    for name in running[0]:
        for one, two in zip(running[0][name], running[1][name]):
            torch.testing.assert_close(two, one, rtol=1e-12, atol=1e-14, msg=name)


CASES = [("mpi", "sso", "kfac", "empirical_fisher", "split", ""),
         ("mpi", "sso", "kfac", "empirical_fisher", "mixed", ""),
         ("mpi", "sso", "diag", "hessian", "mixed", ""), ("mpi", "vi", "kfac", "empirical_fisher", "mixed", ""),
         ("torchrun", "sso", "kfac", "empirical_fisher", "mixed", ""),
         ("ddp", "sso", "kfac", "empirical_fisher", "mixed", ""), ("ddp", "sso", "full", "hessian", "split", ""),
         ("ddp", "vi", "kfac", "empirical_fisher", "split", ""),
         ("mpi", "sso", "kfac", "empirical_fisher", "micro", ""),
         ("ddp", "sso", "diag", "hessian", "micro", ""),
         # adaptive learning rate and momentum: the Hessian's products of an expert this rank did not call are zero
         # (they raised), and under DDP the forward runs again through the module inside the wrapper (DDP's own
         # forward has no forward-mode formula with find_unused_parameters=True)
         ("mpi", "sso", "diag", "hessian", "split", "adaptive"),
         ("ddp", "sso", "kfac", "empirical_fisher", "mixed", "adaptive")]


@pytest.mark.parametrize("launcher,face,approx,kind,routing,options", CASES)
def test_ranks_calling_different_experts_equal_one_process(launcher, face, approx, kind, routing, options):
    """2 ranks, each expert called by one rank only ("split") or one expert by both on other row counts
    ("mixed"), or each rank's two micro-batches meeting the experts in another order ("micro"), and every
    third step an expert no rank calls: parameters and running curvature after 4 steps equal one process
    on the whole batch in one forward to 1e-12, the replicas identical (mpiexec; torchrun with and without
    DistributedDataParallel)."""
    args = [WORKER, face, approx, kind, routing] + (["ddp"] if launcher == "ddp" else []) + options.split()
    cmd = mpiexec_command(*args) if launcher == "mpi" else torchrun_command(*args)
    code, out, _ = launch(cmd, 120.0, TORCHSSO2_DIST_TIMEOUT="30")
    assert code == 0, out
    assert_replicas_equal_one_process(out)


def test_monte_carlo_fisher_with_routed_experts_keeps_the_replicas_equal():
    """The default kind's labels are drawn per rank (no one-process equal): the ranks stay identical."""
    code, out, _ = launch(mpiexec_command(WORKER, "sso", "kfac", "fisher_mc", "mixed"), 120.0,
                          TORCHSSO2_DIST_TIMEOUT="30")
    assert code == 0, out
    replicas = [float(v) for v in re.findall(r"REPLICAS (\d\.\d{3}e[+-]\d{2})", out)]
    assert len(replicas) == 2 and max(replicas) == 0.0, out


def test_kfac_input_factor_of_micro_batches_of_other_lengths_is_the_mean_over_positions():
    """Micro-batches of sequences of other lengths ([4, 2] and [4, 6] tokens): K-FAC's A, a mean over the
    N·T positions of each, is weighted by those positions: the mean over all 32 positions."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5)).double()
    opt = SecondOrderOptimizer(model, approx="kfac", curvature="fisher_mc", lr=0.1, seed=0)  # (A needs no labels)
    xs = [torch.randn(4, t, 3, dtype=torch.float64) for t in (2, 6)]
    ys = [torch.randint(0, 5, (4 * t,)) for t in (2, 6)]

    def closure():
        opt.zero_grad()
        for x, y in zip(xs, ys):
            out = model(x)
            loss = F.cross_entropy(out.reshape(-1, 5), y) * len(y) / 32
            loss.backward()
        return loss, out
    opt.step(closure)
    a = torch.cat([torch.cat([x.reshape(-1, 3), torch.ones(x.shape[0] * x.shape[1], 1, dtype=x.dtype)], 1)
                   for x in xs])
    torch.testing.assert_close(opt.running.blocks["0"].A, a.T @ a / 32, rtol=1e-12, atol=1e-14)


class TokenExperts(nn.Module):
    """Sequence logits [N, T, C]; each token through expert e0 or e1 by its id (a fixed gate); a LayerNorm on
    the [N, T, d] activations (a diagonal block)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(6, 4), nn.LayerNorm(4)
        self.e0, self.e1, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n, t = tokens.shape
        h = self.norm(self.emb(tokens)).reshape(n * t, 4)
        out = h
        for k, expert in enumerate((self.e0, self.e1)):
            rows = ((tokens.reshape(-1) >= 3).long() == k).nonzero().squeeze(1)
            if rows.numel():
                out = out.index_add(0, rows, expert(h[rows]))
        return self.head(out.reshape(n, t, 4))


def test_an_expert_seeing_as_many_rows_as_examples_by_chance_is_not_taken_for_them():
    """K-FAC of the empirical Fisher sums per-row products in any layout: an expert called on 2 tokens of a batch
    of 2 sequences was checked as if its rows were the 2 examples, a ValueError ('the loss rows of an example ...
    reach other examples'), at steps whose routing happened to give it N rows. Its A is the mean over its rows."""
    torch.manual_seed(0)
    model = TokenExperts().double()
    opt = SecondOrderOptimizer(model, approx="kfac", curvature="empirical_fisher", lr=0.1)
    tokens = torch.tensor([[3, 4, 0], [1, 2, 0]])  # e1 gets 2 tokens (= N), both of the first sequence
    y = torch.randint(0, 5, (2, 3))

    def closure():
        opt.zero_grad()
        out = model(tokens)
        loss = F.cross_entropy(out.reshape(-1, 5), y.reshape(-1))
        loss.backward()
        return loss, out
    with torch.no_grad():
        h = model.norm(model.emb(tokens)).reshape(6, 4)[tokens.reshape(-1) >= 3]
    opt.step(closure, targets=y)
    a = torch.cat([h, torch.ones(2, 1, dtype=h.dtype)], 1)
    torch.testing.assert_close(opt.running.blocks["e1"].A, a.T @ a / 2, rtol=1e-12, atol=1e-14)


def test_an_embeddings_input_factor_over_micro_batches_with_other_padding_shares_is_one_forwards():
    """Embedding(padding_idx) under K-FAC: A is a mean over the non-padding positions, and micro-batches with
    3 of 8 and 8 of 8 real tokens are weighted by those (they were weighted by all 8 positions each: A 0.06
    off the one forward on the whole batch)."""
    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(6, 4, padding_idx=0), nn.Linear(4, 3)

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(t).mean(1))
    parts = [torch.tensor([[1, 2, 0, 0], [3, 0, 0, 0]]), torch.tensor([[1, 2, 3, 4], [5, 4, 3, 2]])]
    x, y = torch.cat(parts), torch.tensor([0, 1, 2, 0])
    factors = []
    for micro in (False, True):
        torch.manual_seed(0)
        model = Tokens().double()
        opt = SecondOrderOptimizer(model, approx="kfac", curvature="empirical_fisher", lr=0.1, damping=1.0)

        def closure():
            opt.zero_grad()
            for xs, ys in zip(parts, y.chunk(2)) if micro else [(x, y)]:
                out = model(xs)
                loss = F.cross_entropy(out, ys) * len(ys) / len(y)
                loss.backward()
            return loss, out
        opt.step(closure, targets=y)
        factors.append(opt.running.blocks["emb"].A)
    counts = torch.bincount(x.reshape(-1), minlength=6).double()
    counts[0] = 0
    torch.testing.assert_close(factors[0], counts / 11, rtol=1e-12, atol=0)
    torch.testing.assert_close(factors[1], factors[0], rtol=1e-12, atol=1e-15)
