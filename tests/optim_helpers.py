"""Shared pieces of the optimizer proof tests (issues #5 and #12).

Everything here is independent of the optimizers under test: losses are written out by
hand, gradients come from plain ``torch.autograd``, and reference curvature comes from
:func:`curvature.compute` (itself checked against brute force in ``test_curvature_*``).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import curvature
from curvature.blocks import Block, DiagBlock, FullBlock, KFACBlock


# ---- losses and closures -------------------------------------------------------------------
def nll(loss: str, out: Tensor, y: Tensor) -> Tensor:
    """The mean loss whose curvature the library takes: CE, or ``mean_n ½‖y_n − f_n‖²``."""
    if loss == "cross_entropy":
        return F.cross_entropy(out, y)
    return 0.5 * (out - y).pow(2).reshape(out.shape[0], -1).sum(1).mean()


def masked_mse(out: Tensor, y: Tensor) -> Tensor:
    """½ Σ (out − y)² over the entries with a finite target (NaN marks a missing label), mean over the examples:
    the masked Gaussian NLL a user writes for missing regression labels."""
    seen = torch.isfinite(y)
    return 0.5 * ((out - torch.nan_to_num(y)) ** 2 * seen).sum() / out.shape[0]


def make_closure(opt: torch.optim.Optimizer, model: nn.Module, x: Tensor, y: Tensor, loss: str = "cross_entropy",
                 record: Optional[List] = None, after_backward: Optional[Callable[[], None]] = None
                 ) -> Callable[[], Tuple[Tensor, Tensor]]:
    """Standard closure. ``record`` collects ``{name: param.clone()}`` as seen by the forward
    (the sampled weights, for the VI optimizer); ``after_backward`` may tamper with the gradients."""
    def closure() -> Tuple[Tensor, Tensor]:
        opt.zero_grad()
        if record is not None:
            record.append({n: p.detach().clone() for n, p in model.named_parameters()})
        out = model(x)
        val = nll(loss, out, y)
        val.backward()
        if after_backward is not None:
            after_backward()
        return val, out
    return closure


def kfac_sgd_train(model: nn.Module, x: Tensor, y: Tensor, steps: int = 3, **kfac_kwargs: Any) -> Tensor:
    """``steps`` steps of SGD (lr 0.1) preconditioned by ``KFACPreconditioner(model, **kfac_kwargs)``
    on the batch ``(x, y)``; the flat parameters after them."""
    from torchsso2 import KFACPreconditioner
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, **kfac_kwargs)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        pre.step()
        opt.step()
    return param_vec(model)


# ---- flat vectors ------------------------------------------------------------------------------
def flat(tensors: Sequence[Tensor]) -> Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def param_vec(model: nn.Module) -> Tensor:
    """All parameters in ``named_parameters`` order, flattened."""
    return flat([p for p in model.parameters()])


def set_params(model: nn.Module, values: Dict[str, Tensor]) -> nn.Module:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(values[n])
    return model


def grad_vec(model: nn.Module, x: Tensor, y: Tensor, loss: str = "cross_entropy") -> Tensor:
    """Gradient of the mean loss (plain autograd, no ``.grad`` side effects)."""
    params = list(model.parameters())
    grads = torch.autograd.grad(nll(loss, model(x), y), params)
    return flat(grads)


def offsets(model: nn.Module) -> Dict[int, slice]:
    """``id(param) -> slice`` into :func:`param_vec`."""
    out, i = {}, 0
    for p in model.parameters():
        out[id(p)] = slice(i, i + p.numel())
        i += p.numel()
    return out


# ---- reference curvature -------------------------------------------------------------------------
def ema_blocks(old: Dict[str, Block], new: Dict[str, Block], decay: float) -> Dict[str, Block]:
    """``decay·old + (1 − decay)·new`` on the raw statistics (K-FAC: factor by factor), by hand."""
    out = {}
    for name, b_old in old.items():
        b_new = new[name]
        if isinstance(b_old, KFACBlock):
            out[name] = KFACBlock(b_old.layout, decay * b_old.left + (1 - decay) * b_new.left,
                                  decay * b_old.right + (1 - decay) * b_new.right)
        elif isinstance(b_old, FullBlock):
            out[name] = FullBlock(b_old.layout, decay * b_old.matrix + (1 - decay) * b_new.matrix)
        elif isinstance(b_old, DiagBlock):
            out[name] = DiagBlock(b_old.layout, decay * b_old.diagonal + (1 - decay) * b_new.diagonal)
        else:  # pragma: no cover
            raise TypeError(type(b_old))
    return out


def full_operator(model: nn.Module, blocks: Dict[str, Block], covered: Sequence[nn.Parameter],
                  scale: float, shift: float, uncovered_diag: float) -> Tensor:
    """``[P_all, P_all]`` matrix over *all* parameters: ``scale·C + shift·I`` on the covered
    parameters (block-diagonal, from ``dense()``), ``uncovered_diag·I`` on the others."""
    total = sum(p.numel() for p in model.parameters())
    off = offsets(model)
    mat = torch.zeros(total, total, dtype=torch.float64)
    idx = torch.cat([torch.arange(off[id(p)].start, off[id(p)].stop) for p in covered])
    dense = torch.block_diag(*[b.dense() for b in blocks.values()]).to(torch.float64)
    assert dense.shape[0] == idx.numel()
    mat[idx.unsqueeze(1), idx.unsqueeze(0)] = scale * dense + shift * torch.eye(idx.numel(), dtype=torch.float64)
    covered_ids = {id(p) for p in covered}
    for p in model.parameters():
        if id(p) not in covered_ids:
            s = off[id(p)]
            mat[s, s] = uncovered_diag * torch.eye(p.numel(), dtype=torch.float64)
    return mat


def reference_curvature(model: nn.Module, x: Tensor, y: Tensor, *, loss: str = "cross_entropy", kind: str = "fisher",
                        approx="full", skip_modules=None, generator: Optional[torch.Generator] = None
                        ) -> curvature.Curvature:
    """:func:`curvature.compute` (hooks are removed afterwards; ``.grad`` is not touched)."""
    return curvature.compute(model, x, y, loss=loss, kind=kind, approx=approx,
                             skip_modules=skip_modules, generator=generator)


# ---- small models ------------------------------------------------------------------------------------
class TinyMLP(nn.Module):
    """Linear(4, 5) → tanh → Linear(5, 3)."""

    def __init__(self, d_in: int = 4, hidden: int = 5, out: int = 3) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def tiny_mlp(seed: int = 0, hidden: int = 5, dtype: torch.dtype = torch.float64) -> TinyMLP:
    torch.manual_seed(seed)
    return TinyMLP(hidden=hidden).to(dtype)


def batch(n: int = 12, d_in: int = 4, classes: int = 3, seed: int = 0) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(100 + seed)
    return torch.randn(n, d_in, generator=g, dtype=torch.float64), torch.randint(0, classes, (n,), generator=g)


def linreg_data(n: int = 200, d: int = 3, noise: float = 1.0, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """``X [n, d]`` standard normal with correlated columns, ``y = X w + noise`` as ``[n, 1]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    mix = torch.eye(d, dtype=torch.float64) + 0.3 * torch.randn(d, d, generator=g, dtype=torch.float64)
    x = x @ mix
    w = torch.randn(d, 1, generator=g, dtype=torch.float64)
    y = x @ w + noise * torch.randn(n, 1, generator=g, dtype=torch.float64)
    return x, y


def digits_split(dtype: torch.dtype = torch.float32):
    """sklearn digits scaled to [0, 1], fixed 75/25 split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=dtype)
    y = torch.tensor(y)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=0)
    return xtr, xte, ytr, yte


@contextlib.contextmanager
def failing_decompositions() -> Iterator[Dict[str, bool]]:
    """Every block decomposition the optimizers start raises ``LinalgError("injected")`` while the yielded
    switch's ``"now"`` is True (patched where they call it: ``torchsso2.optim.base`` and
    ``curvature.running``); restored on exit."""
    import curvature.running as running_module
    import torchsso2.optim.base as base_module
    from curvature.linalg import LinalgError

    real = base_module.decompose_block
    switch = {"now": False}

    def decompose_or_fail(blk: Any, *args: Any, **kwargs: Any) -> None:
        if switch["now"]:
            raise LinalgError("injected")
        return real(blk, *args, **kwargs)
    base_module.decompose_block = running_module.decompose_block = decompose_or_fail
    try:
        yield switch
    finally:
        base_module.decompose_block = running_module.decompose_block = real
