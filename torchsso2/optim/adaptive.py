"""Adaptive learning rate and momentum from the damped quadratic model (Martens & Grosse 2015 §7; kfac-jax).

Given the preconditioned direction ``Δ = (C + λI)⁻¹ d`` (``d = g + weight_decay·θ``) and the
previous update ``δ_prev``, the update is ``v = αΔ + μ·δ_prev`` with the coefficients that
minimise the damped quadratic model of the objective along those directions::

    M(w) = ½ wᵀ A w + bᵀ w,   w = (α, μ)
    A_ij = v_iᵀ (G + λI + W) v_j,   b_i = v_iᵀ d,   (v_1, v_2) = (Δ, δ_prev)

``G`` is the exact curvature of the mean loss on the current batch: the GGN
``(1/N) Σ_n J_nᵀ H_n J_n`` (equal to the Fisher for the supported likelihoods) for every Fisher
kind, the Hessian for ``curvature="hessian"``; ``W`` is the weight decay (per parameter group).
``vᵢᵀ G vⱼ`` is computed as kfac-jax does, without forming ``G``: one forward-mode JVP of the
model output per direction (``torch.autograd.forward_ad`` dual numbers through
``torch.func.functional_call``) gives ``J vᵢ`` ([N, *out]); then
``(1/N) Σ_n (J vᵢ)_nᵀ H_n (J vⱼ)_n`` with the likelihood's output Hessian (categorical
``H = diag(p) − ppᵀ``, Gaussian ``H = I``).
For the Hessian: one Hessian-vector product (double backward) per direction.

``w = −A⁻¹ b`` (free coefficients only: a fixed one enters ``b``); on the first step (no
``δ_prev``) only ``α``. ``α`` comes out negative (``Δ`` is an ascent direction): the step
``θ ← θ + αΔ + μ·δ_prev`` is a descent with learning rate ``−α``. When ``M(w) < −L`` (the model
promises more decrease than the objective ``L`` = loss + weight-decay term, which cannot go
below 0, holds) ``w`` is scaled so that ``M = −L`` (:func:`within_objective`). ``M(w)`` at the
(scaled) solution is the predicted change of the loss that the Levenberg–Marquardt damping rule
(:class:`torchsso2.optim.damping.LMDamping`) compares with the actual change.

The model inputs of the closure's forward are recorded (a forward pre-hook, see
:class:`InputRecorder`) and the model is run again in forward mode with
``torch.func.functional_call``, with copies of its buffers (BatchNorm running statistics are not
updated twice) and, on CPU, the global RNG state of the original forward (the same dropout mask).

With several processes each rank computes ``vᵢᵀ G vⱼ`` on its own examples and the ``[k, k]``
Gram is averaged over the ranks (one allreduce of k² numbers per step). Each rank's Gram is that
of the mean loss over its own examples, and the objective of several processes is the mean of the
ranks' mean losses (the gradients are averaged the same way), so its curvature is the mean of the
ranks' curvatures; the linear terms ``b = vᵀd`` and the damping and weight-decay terms are already
equal on every rank (averaged gradients, equal directions). So every rank solves the same
coefficients: W ranks on W equal shards equal one process on the whole batch.
"""
from __future__ import annotations

import contextlib
import logging
import math
import random
import sys
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from curvature.blocks.base import owned_all_finite
from curvature.hook_marks import LocalHook, in_func_transform
from curvature.likelihoods import bernoulli_std, class_softmax, loss_rows, mean_nll
from curvature.options import Kind, LossType
from curvature.root_calls import NestedCalls
from curvature.uses_static import observer_hook

from . import sequential_jvp
from .sequential_record import ActivationRecorder
from .clipped_update import clip_scale
from .precision import autocast_state

logger = logging.getLogger(__name__)

#: a recorded forward call: (positional args, keyword args, (CPU RNG state, {CUDA device: RNG state}) before
#: the forward)
Call = Tuple[Tuple[Any, ...], Dict[str, Any], Tuple[Tensor, Dict[int, Tensor]]]


class InputRecorder:
    """Records the inputs of every forward of ``model`` while active (a forward pre-hook), and its
    output (a forward hook; ``outputs[i]`` of ``calls[i]``). Both hooks only record
    (:func:`curvature.uses_static.observer_hook`): a K-FAC capture in the same forward still knows
    that a plain ``nn.Sequential`` cannot use a parameter outside its layers' calls."""

    def __init__(self) -> None:
        self.calls: List[Call] = []
        self.outputs: List[Any] = []
        #: the version counters of each output's tensors when its forward returned: an in-place change since
        #: (``logits.div_(T)`` in the closure) is not what a forward of the recorded input gives
        self.versions: List[List[int]] = []
        #: whether each forward ran under autocast (a forward of the recorded input outside it differs)
        self.autocast: List[bool] = []
        #: for a model the hand-written J·v pass supports, its children's outputs in each forward
        self.activations: Optional[ActivationRecorder] = None
        #: record them (off where the pass is not used: the Hessian, an ``output_selector``)
        self.keep_activations = True

    def __deepcopy__(self, memo: Dict[int, Any]) -> "InputRecorder":
        """A recorder with the same settings and nothing recorded: the last step's forward (its inputs,
        its output and activations, which autograd's non-leaf tensors cannot deep-copy) is scratch of
        that step, not optimizer state, and the next closure records its own."""
        copy = InputRecorder()
        copy.keep_activations = self.keep_activations
        return copy

    @contextlib.contextmanager
    def record(self, model: nn.Module) -> Iterator["InputRecorder"]:
        self.calls = []
        self.outputs = []
        self.versions = []
        self.autocast = []
        self.activations = ActivationRecorder() if self.keep_activations and sequential_jvp.supports_model(model) \
            else None
        child_handles = self.activations.attach(model) if self.activations is not None else []  # type: ignore[arg-type]

        nesting = NestedCalls()  # a wrapper's call around the model's (curvature/root_calls.py) is dropped
        # per open call, innermost last: what a completed call records (None: a call not recorded, with
        # gradients disabled or in a torch.func transform); recorded when it completes, so a forward that
        # raised (caught in the closure) is never replayed
        open_calls: List[Optional[Tuple[Call, Any]]] = []

        def hook(module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
            nesting.enter(module)
            open_calls.append(None)
            if in_func_transform():
                return
            if not torch.is_grad_enabled():  # a metric on other inputs inside the closure: not the batch's loss
                if self.activations is not None:
                    self.activations.skip()
                return
            started = self.activations.start(module, args, kwargs) if self.activations is not None else None
            open_calls[-1] = ((args, dict(kwargs), rng_states(module)), started)

        def out_hook(module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
            opened = open_calls.pop() if open_calls else None
            if not nesting.leave() or opened is None:  # a wrapper's call (the model's ran inside it), or unrecorded
                return
            call, started = opened
            self.calls.append(call)
            self.outputs.append(output)
            self.versions.append(output_versions(output))
            self.autocast.append(bool(autocast_state()))
            if self.activations is not None:
                self.activations.records.append(started)

        handles = [model.register_forward_pre_hook(LocalHook(observer_hook(hook)), with_kwargs=True),
                   model.register_forward_hook(LocalHook(observer_hook(out_hook)))]
        try:
            yield self
        finally:
            for handle in handles + child_handles:
                handle.remove()


def output_versions(output: Any) -> List[int]:
    """The version counters of the tensors in ``output`` (a tensor, or a dict, tuple, list or registered output
    object of them): a view shares its base's, so an in-place change of a pick shows too."""
    return [leaf._version for leaf in tree_flatten(output)[0] if isinstance(leaf, Tensor)]


def output_hessian_inner(loss: LossType, outputs: Tensor, u: Tensor, w: Tensor) -> Tensor:
    """``Σ_n u_nᵀ H_n w_n`` (a 0-dim tensor, summed over the batch) with ``H_n = ∂²ℓ_n/∂f_n²`` at
    ``outputs`` ([N, C] or [N, T, C] logits for cross_entropy, classes last; [N, ...] for mse);
    ``u, w`` of the outputs' shape: the inner product of their :func:`output_hessian_root`."""
    class_dim = outputs.dim() - 1
    return (output_hessian_root(loss, outputs, u, class_dim) * output_hessian_root(loss, outputs, w, class_dim)).sum()


def _functional(model: nn.Module, names: Sequence[str], select: Callable[[Any], Tensor], call: Call
                ) -> Callable[..., Tensor]:
    """``f(*params) -> selected output`` of ``model`` on a recorded call; buffers are copies."""
    args, kwargs, _ = call
    buffers = {n: b.clone() for n, b in model.named_buffers()}

    def f(*ps: Tensor) -> Tensor:
        return select(torch.func.functional_call(model, ({**dict(zip(names, ps)), **buffers}), args, kwargs))
    return f


def rng_states(module: nn.Module, host: bool = False) -> Tuple[Any, ...]:
    """The CPU RNG state and that of each CUDA device holding ``module``'s parameters (dropout on a GPU
    draws from the device's generator): what a recorded forward saw. ``host``: also Python's ``random``
    and NumPy's global generators (a closure's own augmentation, mixup: what a second call of the user's
    closure replays; ~60 µs, taken at the LM rule's steps)."""
    cpu = torch.get_rng_state()
    if not torch.cuda.is_initialized():  # no CUDA tensor can exist: no walk over the parameters at every step
        cuda: Dict[int, Tensor] = {}
    else:
        devices = {p.device.index if p.device.index is not None else torch.cuda.current_device()
                   for p in module.parameters() if p.device.type == "cuda"}
        cuda = {d: torch.cuda.get_rng_state(d) for d in sorted(devices)}
    if host:
        return cpu, cuda, (random.getstate(), np.random.get_state())
    return cpu, cuda


@contextlib.contextmanager
def _rng_of(call: Call) -> Iterator[None]:
    """Run with the RNG states the recorded forward saw, CPU and CUDA (restored afterwards): its dropout masks,
    and the user's streams left as they were."""
    with replayed_rng(call[2]):
        yield


@contextlib.contextmanager
def replayed_rng(states: Tuple[Any, ...]) -> Iterator[None]:
    """Run with the RNG ``states`` of :func:`rng_states` (CPU, each CUDA device's, and with ``host`` Python's
    and NumPy's), restored afterwards: the random numbers drawn inside are those drawn after the states were
    taken, and the user's streams stay as they were before the block."""
    cpu, cuda = states[0], states[1]
    host = states[2] if len(states) > 2 else None
    before = (random.getstate(), np.random.get_state()) if host is not None else None
    with torch.random.fork_rng(devices=list(cuda)):
        torch.set_rng_state(cpu)
        for device, state in cuda.items():
            torch.cuda.set_rng_state(state, device)
        if host is not None:
            random.setstate(host[0])
            np.random.set_state(host[1])
        try:
            yield
        finally:
            if before is not None:
                random.setstate(before[0])
                np.random.set_state(before[1])


def output_hessian_root(loss: LossType, outputs: Tensor, u: Tensor, class_dim: int = 1) -> Tensor:
    """``r_n`` with ``r_nᵀ r'_n = u_nᵀ H_n u'_n`` for every example (shape of ``u``): categorical
    ``√p ⊙ (u − pᵀu)`` (``H = diag p − p pᵀ``), Gaussian ``u``, Bernoulli ``√(p(1 − p)) ⊙ u``
    (``H = diag(p(1 − p))``, ``p = sigmoid(f)``). A Gram matrix of these is positive
    semi-definite in floating point too: the expanded ``Σ p u² − (pᵀu)²`` cancels where the softmax is
    saturated (a converged model: float32 gave −64 for a value ≥ 0) and made the quadratic model
    indefinite. ``class_dim``: the dimension of the classes in ``outputs`` and ``u`` (the last for
    [N, T, C] sequence logits; ``outputs`` may have size-1 leading dimensions that broadcast against
    ``u``, e.g. [1, N, C] against [k, N, C])."""
    if loss is LossType.CROSS_ENTROPY:
        p = class_softmax(outputs.detach(), class_dim)
        return p.sqrt() * (u - (p * u).sum(class_dim, keepdim=True))
    if loss is LossType.BINARY_CROSS_ENTROPY:
        return bernoulli_std(outputs.detach()) * u
    return u


@contextlib.contextmanager
def forward_mode_kernels() -> Iterator[None]:
    """Attention on kernels that have forward-mode formulas, for the block: ``scaled_dot_product_attention``'s
    math backend (the fused flash / memory-efficient kernels have none: a NotImplementedError) and no fast
    path of ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` (a fused op without one, taken under
    ``no_grad`` or in eval mode). The same attention, up to rounding; models without attention unaffected."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)


def _dual_jvps(model: nn.Module, names: Sequence[str], select: Callable[[Any], Tensor], call: Call,
               primals: Sequence[Tensor], directions: Sequence[Sequence[Tensor]]) -> Tuple[Tensor, List[Tensor]]:
    """The output of a recorded forward and ``J v`` (flattened) for every direction: one
    forward-mode pass (dual numbers) per direction, with the forward's RNG state and buffer copies."""
    f = _functional(model, names, select, call)
    if "torch._decomp.decompositions_for_jvp" not in sys.modules:  # once: catch_warnings' exit resets Python's
        # once-per-location warning registry, which the user's warnings rely on
        with warnings.catch_warnings():  # torch's first make_dual loads its JVP decompositions by torch.jit.script,
            warnings.simplefilter("ignore", DeprecationWarning)  # deprecated: 18 DeprecationWarnings of torch's own
            import torch._decomp.decompositions_for_jvp  # noqa: F401
    jvs = []
    out = None
    for v in directions:
        with _rng_of(call), fwAD.dual_level(), forward_mode_kernels():
            try:
                res = f(*[fwAD.make_dual(p, t.detach().to(p.dtype)) for p, t in zip(primals, v)])
            except NotImplementedError as err:
                if "forward" not in str(err).lower() and "jvp" not in str(err).lower():
                    raise
                raise NotImplementedError(
                    "adaptive mode (use_adaptive_learning_rate / use_adaptive_momentum) computes J·v of the model by "
                    "forward-mode AD (dual numbers), and an operation of this model's forward has no forward-mode "
                    f"formula: {err} A custom torch.autograd.Function needs a jvp staticmethod (or "
                    "torch.func-style setup_context + jvp); otherwise use the fixed lr/momentum (adaptive off). "
                    "The optimizer is as it was before this step.") from err
            out, jv = fwAD.unpack_dual(res)
        if jv is None:  # the output does not depend on the optimized parameters
            jv = torch.zeros_like(out)
        jvs.append(jv.reshape(-1))
    assert out is not None
    return out, jvs


def ggn_gram(model: nn.Module, calls: Sequence[Call], names: Sequence[str], params: Sequence[Tensor],
             directions: Sequence[Sequence[Tensor]], loss: LossType, select: Callable[[Any], Tensor],
             identity_select: bool = False, activations: Optional[ActivationRecorder] = None,
             stacked: Optional[Sequence[Tensor]] = None) -> Tensor:
    """``[k, k]`` float64 matrix ``v_iᵀ G v_j``, ``G = (1/N) Σ_n J_nᵀ H_n J_n`` over all recorded
    forwards (N examples in all): one forward-mode pass (dual numbers) per direction and forward,
    or, when ``identity_select`` (the model output is the loss input) and the model is a plain
    ``nn.Sequential`` (:mod:`torchsso2.optim.sequential_jvp`), one hand-written pass for all
    directions (taking the primal values from the recorded forward where ``activations`` has them:
    :mod:`torchsso2.optim.sequential_record`). ``stacked``: the directions already stacked per
    parameter (``stacked[i]`` [k, *params[i].shape], ``directions[j][i]`` at ``[j]``), for that pass;
    else stacked here."""
    k = len(directions)
    gram: Optional[Tensor] = None
    total = 0
    primals: Optional[List[Tensor]] = None
    tangents: Optional[Dict[int, Tensor]] = None
    scales: Optional[List[float]] = None
    if any(p.dtype in _HALF for p in params):  # J·v is linear in v: each direction scaled to max |v| <= 1 (a power
        # of two, exact) so that float16 tangents do not overflow (a first step's Δ of ~1e3 on inputs ~1e2 did);
        # the Gram is scaled back in float64
        scales = [_pow2_scale(d) for d in directions]
        directions = [[t / c for t in d] for d, c in zip(directions, scales)]
        stacked = None
    for index, call in enumerate(calls):
        if identity_select and sequential_jvp.supports(model, call[0], call[1]):
            # an nn.Sequential of plain layers: all directions in one hand-written pass (same products)
            if tangents is None:  # keyed by the model's own parameters, in their dtypes
                stacks = _param_stacks(directions) if stacked is None else stacked
                tangents = {id(p): t if t.dtype == p.dtype else t.to(p.dtype) for p, t in zip(params, stacks)}
            recorded = activations.usable(model, index) if activations is not None else None  # type: ignore[arg-type]
            out, jv = sequential_jvp.sequential_jvps(model, call[0][0], tangents, recorded)  # [k, N, ...]
            rmat = output_hessian_root(loss, out.unsqueeze(0), jv, class_dim=out.dim()).reshape(k, -1)
        else:
            if primals is None:
                primals = [p.detach() for p in params]
            out, jvs = _dual_jvps(model, names, select, call, primals, directions)
            rmat = torch.stack([output_hessian_root(loss, out, j.view_as(out), class_dim=out.dim() - 1).reshape(-1)
                                for j in jvs])  # [k, N·out]
        total += loss_rows(loss, out)  # N, or N·T for cross-entropy logits [N, T, C] (the rows the loss averages)
        if rmat.dtype in _HALF:  # the sums of products overflow float16's 65504
            rmat = rmat.float()
        part = (rmat @ rmat.t()).double()
        gram = part if gram is None else gram.add_(part)
    if gram is None:
        return torch.zeros(k, k, dtype=torch.float64)
    if scales is not None:
        c = torch.tensor(scales, dtype=torch.float64)
        gram = gram * torch.outer(c, c)
    return (gram + gram.t()).mul_(0.5 / max(total, 1))


_HALF = (torch.float16, torch.bfloat16)


def _pow2_scale(tensors: Sequence[Tensor]) -> float:
    """The power of two at or above ``max |t|`` over ``tensors`` (1 for zero or non-finite tensors)."""
    top = max((float(t.detach().abs().max()) for t in tensors if t.numel()), default=0.0)
    if not math.isfinite(top) or top <= 0:
        return 1.0
    return float(2.0 ** math.ceil(math.log2(top)))


def hessian_gram(model: nn.Module, calls: Sequence[Call], names: Sequence[str], params: Sequence[Tensor],
                 directions: Sequence[Sequence[Tensor]], loss: LossType, select: Callable[[Any], Tensor],
                 targets: Optional[Tensor]) -> Tensor:
    """``[k, k]`` float64 matrix ``v_iᵀ ∇²L v_j`` of the mean loss ``L`` on the recorded forward
    (one forward per closure; ``targets`` of that batch): one Hessian-vector product per direction."""
    if targets is None:
        raise ValueError("curvature='hessian' with an adaptive learning rate or momentum needs step(closure, targets=...)")
    if len(calls) != 1:
        raise ValueError(f"curvature='hessian' with an adaptive learning rate or momentum supports one forward per "
                         f"closure, the closure ran {len(calls)}")
    f = _functional(model, names, select, calls[0])
    leaves = [p.detach().requires_grad_(True) for p in params]
    # (the attention kernels with a double backward; a parameter this batch does not reach, an expert another
    # rank used, has no gradient here: its products are zero)
    with torch.enable_grad(), _rng_of(calls[0]), forward_mode_kernels():
        value = mean_nll(loss, f(*leaves), targets)
        grads = torch.autograd.grad(value, leaves, create_graph=True, allow_unused=True)
        hvs: List[Sequence[Optional[Tensor]]] = []
        for v in directions:
            dot = sum(((g * t.detach()).sum() for g, t in zip(grads, v) if g is not None), torch.zeros(()))
            hvs.append(torch.autograd.grad(dot, leaves, retain_graph=True, allow_unused=True)
                       if dot.requires_grad else [None] * len(leaves))
    k = len(directions)
    gram = torch.zeros(k, k, dtype=torch.float64)
    for i in range(k):
        for j in range(k):
            gram[i, j] = sum(float((h * t).double().sum()) for h, t in zip(hvs[j], directions[i]) if h is not None)
    return 0.5 * (gram + gram.t())


def _param_stacks(vectors: Sequence[Sequence[Tensor]]) -> List[Tensor]:
    """``[m, *shape_i]`` for every parameter ``i``: its tensors of the ``m`` per-parameter lists
    ``vectors`` stacked (``vectors[j][i]`` at ``[j]``; no autograd history; mixed dtypes promoted)."""
    with torch.no_grad():
        return [torch.stack(ts) for ts in zip(*vectors)]


def _flat_rows64(stacks: Sequence[Tensor]) -> Tensor:
    """``[m, P]`` float64: row ``j`` the concatenation over the parameters of ``stacks[i][j]``
    flattened (``stacks``: :func:`_param_stacks` of ``m`` lists, ``P`` their total size)."""
    m = stacks[0].shape[0]
    return torch.cat([t.reshape(m, -1) for t in stacks], 1).double()


def inner_products(xs: Sequence[Sequence[Tensor]], ys: Sequence[Sequence[Tensor]],
                   weights: Optional[Sequence[float]] = None) -> Tensor:
    """``[len(xs), len(ys)]`` float64 matrix of ``Σ_p weight_p x_{i,p}ᵀ y_{j,p}`` (weight 1 without ``weights``)."""
    def flat(vs: Sequence[Tensor], w: Optional[Sequence[float]]) -> Tensor:
        return torch.cat([(t.detach() if w is None else t.detach() * w[i]).reshape(-1).double()
                          for i, t in enumerate(vs)])
    return torch.stack([flat(x, weights) for x in xs]) @ torch.stack([flat(y, None) for y in ys]).t()


#: two free directions whose model matrix has ``|det| <= COLLINEAR_EPS·eps·a₀₀·a₁₁`` (``eps`` the machine
#: epsilon of the model's compute dtype, float32 or wider) are taken as parallel: ``det/(a₀₀·a₁₁) = 1 − cos²``
#: of their angle in the model's metric is then rounding, and the 2x2 solve is noise, so the step is solved
#: along the first alone. float32: below 7.6e-6 (an angle under ~3e-3 rad); float64: below 1.4e-14.
COLLINEAR_EPS = 64


def collinear_rtol(dtype: torch.dtype) -> float:
    """``COLLINEAR_EPS·eps`` of ``dtype`` computed in float32 or wider (bfloat16 / float16 models' Gram
    entries are float32 products)."""
    return COLLINEAR_EPS * torch.finfo(torch.promote_types(dtype, torch.float32)).eps


def solve_quadratic(a: Tensor, b: Tensor, fixed: Sequence[Optional[float]]) -> Tuple[List[float], float]:
    """Minimise ``M(w) = ½ wᵀ a w + bᵀ w`` (``a`` [k, k] symmetric, ``b`` [k], k ≤ 2) over the entries
    of ``w`` whose ``fixed`` value is None (the others keep their value), in closed form in float64
    Python arithmetic. Returns ``(w, M(w))``; raises ``ValueError`` when the model restricted to
    the free entries is not positive definite (it then has no minimum). Two free entries whose
    directions are parallel to within rounding of ``a``'s dtype (:func:`collinear_rtol`; a singular
    ``a``) are solved as the first alone, the second 0: the minimum of ``M`` along the first direction
    (the 2x2 minimum too when ``b`` lies in ``a``'s range, as for Δ and δ_prev preconditioned by the
    model's own curvature)."""
    n = len(fixed)
    if n not in (1, 2) or tuple(a.shape) != (n, n) or tuple(b.shape) != (n,):
        raise ValueError(f"expected 1 or 2 coefficients with a [{n}, {n}] and b [{n}], got {len(fixed)}, "
                         f"{tuple(a.shape)} and {tuple(b.shape)}")
    return _solve_lists(a.tolist(), b.tolist(), fixed, collinear_rtol(a.dtype))


def _solve_lists(am: List[List[float]], bv: List[float], fixed: Sequence[Optional[float]],
                 rtol: float) -> Tuple[List[float], float]:
    """:func:`solve_quadratic` of ``a`` and ``b`` given as nested Python lists of floats (shapes unchecked)."""
    n = len(fixed)
    w = [0.0 if c is None else float(c) for c in fixed]
    free = [i for i, c in enumerate(fixed) if c is None]
    if len(free) == 2:
        det = am[0][0] * am[1][1] - am[0][1] * am[1][0]
        if am[0][0] > 0 and am[1][1] > 0 and abs(det) <= rtol * am[0][0] * am[1][1]:
            # the two directions (Δ and δ_prev) are parallel to within rounding (a least-squares problem
            # whose every preconditioned gradient is parallel to the last update): any split of one
            # step between them has the same model value and the 2x2 solve is rounding noise, so the
            # step is taken along Δ alone (δ_prev's coefficient 0), the minimum of the model there
            return _solve_lists(am, bv, [None, 0.0], rtol)
        if not (am[0][0] > 0 and det > 0):
            raise ValueError(f"the quadratic model is not positive definite on the free directions: {am}")
        w = [-(am[1][1] * bv[0] - am[0][1] * bv[1]) / det, -(am[0][0] * bv[1] - am[1][0] * bv[0]) / det]
    elif len(free) == 1:
        i = free[0]
        if not am[i][i] > 0:
            raise ValueError(f"the quadratic model is not positive definite on the free direction: {am[i][i]}")
        w[i] = -(bv[i] + sum(am[i][j] * w[j] for j in range(n) if j != i)) / am[i][i]
    value = 0.5 * sum(w[i] * am[i][j] * w[j] for i in range(n) for j in range(n)) + sum(x * y for x, y in zip(w, bv))
    return w, value


def param_names(model: nn.Module, params: Sequence[Tensor]) -> List[str]:
    """The ``named_parameters`` name of every parameter; ValueError for one not in ``model``."""
    names = {id(p): n for n, p in model.named_parameters()}
    missing = [tuple(p.shape) for p in params if id(p) not in names]
    if missing:
        raise ValueError(f"adaptive coefficients need every optimized parameter to be a parameter of the model "
                         f"(the JVP runs the model); parameters of shapes {missing} are not")
    return [names[id(p)] for p in params]


class AdaptiveCoefficients:
    """The adaptive step of :class:`~torchsso2.optim.SecondOrderOptimizer` (see the module docstring).

    ``learning_rate`` / ``momentum``: adapt ``α`` / ``μ`` (a coefficient not adapted is fixed to
    ``−lr`` / ``momentum`` of the param groups, which must then agree on it). State (saved in the
    optimizer's ``state_dict``): ``δ_prev`` per parameter in ``optimizer.state[p]["adaptive_delta"]``,
    and here ``last`` (the last coefficients, quadratic-model value and step count).
    """

    def __init__(self, learning_rate: bool, momentum: bool, interval: int = 1) -> None:
        self.learning_rate = learning_rate
        self.momentum = momentum
        #: solve the coefficients every ``interval`` adaptive steps (and at the first two steps and
        #: every Levenberg–Marquardt step); reuse the last ones in between (:meth:`reused`)
        self.interval = interval
        self.recorder = InputRecorder()
        self._names: Optional[Tuple[Tuple[int, ...], List[str]]] = None
        #: the last step's ``learning_rate = −α``, ``momentum = μ``, ``quad_model = M(w)``, ``steps``
        self.last: Dict[str, float] = {"learning_rate": float("nan"), "momentum": float("nan"),
                                       "quad_model": float("nan"), "steps": 0}
        #: whether the last :func:`adaptive_step` found no minimum of the quadratic model (finite, with negative
        #: curvature along the step: the Hessian of a non-convex loss), not a non-finite step
        self.no_minimum = False
        #: whether the last solved quadratic model's entries were all finite (set by :meth:`coefficients`)
        self.model_finite = False

    def record(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self.recorder.record(model)

    @staticmethod
    def _one(values: List[Any], what: str) -> float:
        if any(v != values[0] for v in values):
            raise ValueError(f"a fixed {what} with adaptive coefficients needs one value over all param groups, "
                             f"got {sorted(set(values))}")
        return float(values[0])

    def reused(self, opt: Any, groups: List[Dict[str, Any]], first: bool) -> Optional[List[float]]:
        """``[α, μ]`` to take again at this step without solving, or None when this step solves.

        With ``interval`` k > 1 the coefficients are solved at every k-th adaptive step, at the
        first two (``α`` alone, then ``α`` and ``μ``; also at a ``first`` step without ``δ_prev``)
        and at every step the Levenberg–Marquardt rule runs after (it compares the loss change with
        this step's quadratic model); the steps between take the last step's adapted coefficients
        (after :func:`within_objective`) with the new ``Δ`` and ``δ_prev``, and have no model value
        (``last["quad_model"]`` is NaN). A coefficient that is not adapted is the group's current one."""
        steps = int(self.last["steps"])
        if self.interval == 1 or first or steps < 2 or steps % self.interval == 0 or opt._adapt_now():
            return None
        alpha = -self.last["learning_rate"] if self.learning_rate else -self._one([g["lr"] for g in groups], "lr")
        mu = self.last["momentum"] if self.momentum else self._one([g["momentum"] for g in groups], "momentum")
        return [alpha, mu]

    def coefficients(self, opt: Any, params: List[nn.Parameter], groups: List[Dict[str, Any]],
                     deltas: List[Tensor], vecs: List[Tensor], prev: Optional[List[Tensor]],
                     targets: Optional[Tensor]) -> Tuple[List[float], float, float, List[Optional[float]]]:
        """``([α, μ], M, M_fixed, fixed)`` for the directions ``deltas`` (Δ) and ``prev`` (δ_prev, None on
        the first step) with the gradient ``vecs`` (d): the coefficients, the model's value there, its
        value at the fixed coefficients alone (the free ones 0; 0 when all are free) and which are
        fixed (a value) or solved (None)."""
        # the forward is run again through the module a DistributedDataParallel wrapper holds (DDP's own forward
        # prepares its reducer, whose autograd function has no forward-mode formula)
        model = opt.model.module if isinstance(opt.model, nn.parallel.DistributedDataParallel) else opt.model
        key = tuple(map(id, params))
        if self._names is None or self._names[0] != key:  # the parameters' names, kept while they are the same
            self._names = (key, param_names(model, params))
        names = self._names[1]
        if not self.recorder.calls:
            raise RuntimeError("adaptive coefficients need the closure to call the model itself (its forward is "
                               "recorded to run it again in forward mode); no call of the model was seen")
        fixed: List[Optional[float]] = [None if self.learning_rate else -self._one([g["lr"] for g in groups], "lr")]
        dirs = [deltas]
        if prev is not None:
            fixed.append(None if self.momentum else self._one([g["momentum"] for g in groups], "momentum"))
            dirs.append(prev)
        k = len(dirs)
        # per parameter [k + 1, *shape]: the directions and d, stacked once for the J·v pass's tangents
        # (the first k rows) and for the inner products below (one cat of the parameters' rows)
        stacks = _param_stacks([*dirs, vecs])
        if opt.engine.kind is Kind.HESSIAN:
            gram = hessian_gram(model, self.recorder.calls, names, params, dirs, opt.engine.loss,
                                opt.engine.select_output, targets)
        else:
            gram = ggn_gram(model, self.recorder.calls, names, params, dirs, opt.engine.loss,
                            opt.engine.select_output, identity_select=opt.engine.output_selector is None,
                            activations=self.recorder.activations, stacked=[t[:k] for t in stacks])
        self.recorder.activations = None  # the forward's activations are not kept past their use
        gram = opt._mean_tensor_over_ranks(gram)  # the same coefficients on every rank (module docstring)
        wds = [float(g["weight_decay"]) for g in groups]
        flat = _flat_rows64(stacks)  # [k + 1, P]: the directions, d
        inner = (flat @ flat.t()).tolist()  # [k + 1, k + 1]: vᵢᵀvⱼ and (last column) vᵢᵀd in one product
        # a = gram + λ·vᵢᵀvⱼ (+ the weight decay's), b = vᵢᵀd: the k ≤ 2 entries in float64 Python
        # arithmetic, the same IEEE operations as on the [k, k] tensors, without their small ops
        gl = gram.tolist()
        a = [[gl[i][j] + opt.damping * inner[i][j] for j in range(k)] for i in range(k)]
        if any(wds):
            decay = inner_products(dirs, dirs, wds).tolist()
            a = [[a[i][j] + decay[i][j] for j in range(k)] for i in range(k)]
        bv = [inner[i][k] for i in range(k)]
        self.model_finite = all(math.isfinite(x) for row in a for x in row) and all(math.isfinite(x) for x in bv)
        w, value = _solve_lists(a, bv, fixed, collinear_rtol(params[0].dtype))
        f = [0.0 if c is None else float(c) for c in fixed]  # the fixed part alone: M there, for within_objective
        base = 0.5 * sum(f[i] * a[i][j] * f[j] for i in range(k) for j in range(k)) \
            + sum(f[i] * inner[i][k] for i in range(k))
        return w, value, base, fixed

    def state_dict(self) -> Dict[str, Any]:
        return dict(self.last)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        missing = {"learning_rate", "momentum", "quad_model", "steps"} - set(state)
        if missing:
            raise ValueError(f"adaptive state lacks {sorted(missing)}")
        self.last = {k: (int(v) if k == "steps" else float(v)) for k, v in state.items()}


def within_objective(w: Sequence[float], value: float, objective: Optional[float],
                     fixed: Optional[Sequence[Optional[float]]] = None, base: float = 0.0) -> Tuple[List[float], float]:
    """Scale the solved free coefficients of ``w`` (model value ``M(w) = value < 0``) by the
    ``t ∈ [0, 1]`` that keeps the predicted decrease at most ``objective`` (the current loss plus
    weight decay, ≥ 0). The objective cannot go below 0, so a model promising more is being used
    far outside the region where it describes the loss; an exact quadratic model of a non-negative
    objective never promises more than the objective itself (there ``t = 1``).

    ``fixed``: as for :func:`solve_quadratic` (a coefficient with a value is fixed and not scaled;
    default: all free); ``base``: ``M`` at the fixed coefficients with the free ones 0 (0 when all
    are free). With ``u`` the free part, ``w`` minimises ``M`` along it, so
    ``M(t) = base − q·t + ½q·t²`` with ``q = 2(base − value) ≥ 0``: ``t = 1 − √(1 − 2(base + objective)/q)``
    (all free: ``1 − √(1 − objective/|value|)``, ``M(t·w) = value·(2t − t²)``), and ``t = 0`` when the
    fixed part alone promises more than ``objective``.
    Returns ``(w with its free entries times t, M there)``; unchanged when ``objective`` is None."""
    if objective is None or not value < -objective or not math.isfinite(objective):
        return list(w), value
    free = [True] * len(w) if fixed is None else [c is None for c in fixed]
    q = 2.0 * (base - value)
    t = 1.0 - math.sqrt(max(0.0, 1.0 - 2.0 * (base + objective) / q)) if base + objective >= 0 and q > 0 else 0.0
    return [t * c if f else c for c, f in zip(w, free)], base + q * (0.5 * t * t - t)


def _foreach_scalar(value: float, tensors: Sequence[Tensor]) -> Any:
    """``value`` as the factor of ``torch._foreach_mul(tensors, ·)``: a 0-dim tensor of their dtype
    when they are all float32 or all float64 CPU tensors, else the Python float. On CPU the list
    form with a Python float wraps it into a tensor once per tensor (digits MLP, 4 tensors: ~10 µs
    against ~6 µs with the 0-dim tensor, its creation included); the product is the same: the
    kernel takes a Python scalar in the tensors' dtype for float32/float64 (in float for half
    precision, hence the Python float there, as :class:`torchsso2.optim.plan.ScalarCache` does)."""
    first = tensors[0] if tensors else None
    if first is None or first.device.type != "cpu" or first.dtype not in (torch.float32, torch.float64) \
            or any(t.dtype != first.dtype or t.device != first.device for t in tensors):
        return value
    return torch.scalar_tensor(value, dtype=first.dtype)


def decay_term(params: Sequence[Tensor], wds: Sequence[float]) -> float:
    """``Σ_p ½·wd_p·‖θ_p‖²``: the weight decay's part of the objective the quadratic model describes
    (its gradient ``wd·θ`` is in ``d``, its curvature in ``A``), in float64."""
    return sum(0.5 * wd * float(p.detach().double().pow(2).sum()) for p, wd in zip(params, wds) if wd)


def _forget_previous_update(states: Sequence[Dict[str, Any]]) -> None:
    """Drop δ_prev after a step that did not move: a zero δ_prev would make the next steps' 2×2 model
    singular for good; the next step solves for α alone, as the first one."""
    for s in states:
        s.pop("adaptive_delta", None)


def adaptive_step(opt: Any, params: List[nn.Parameter], groups: List[Dict[str, Any]],
                  targets: Optional[Tensor], loss: Optional[float] = None) -> Optional[float]:
    """Apply ``θ ← θ + αΔ + μ·δ_prev`` with the solved coefficients (``opt`` a
    :class:`SecondOrderOptimizer` in adaptive mode). ``loss``: the batch loss before the step (the
    mean over ranks), for :func:`within_objective`. Returns the quadratic model's value ``M``
    (the predicted change of the loss; NaN at a step that reused the last coefficients), or None
    (nothing changed) when the step is not finite or the quadratic model has no minimum."""
    ada: AdaptiveCoefficients = opt.adaptive
    ada.no_minimum = ada.model_finite = False
    plan = opt._plan(params, groups)
    wds = plan.values("weight_decay")
    vecs = [p.grad.detach() if not wd else p.grad.detach() + wd * p.detach() for p, wd in zip(params, wds)]
    if opt.placement.active:
        solved = opt._precondition({blk.layout.name: blk for blk, _ in plan.blocks},
                                   {id(p): v for p, v in zip(params, vecs)})
        deltas = [solved[id(p)] for p in params]
    else:
        deltas = plan.precondition(vecs, solved=opt._low_rank_solve(plan, vecs, wds))
    if not ada.learning_rate and opt.kl_clip is not None:
        # adaptive momentum alone: the fixed lr sets the step along Δ, clipped as in the plain mode
        # (ν = min(1, √(kl_clip / Σ lr²·Δᵀd))) before μ is solved for it
        lr = ada._one([g["lr"] for g in groups], "lr")
        nu = clip_scale(deltas, vecs, [lr] * len(deltas), opt.kl_clip)
        if nu is not None and nu != 1.0:  # None: a non-finite Δ, refused below like any
            deltas = [dl * nu for dl in deltas]
    states = [opt.state[p] for p in params]
    prev: Optional[List[Tensor]] = None  # the first step: no previous update, only α
    if any("adaptive_delta" in s for s in states):
        prev = [s["adaptive_delta"] if "adaptive_delta" in s else torch.zeros_like(p) for s, p in zip(states, params)]
    reused = ada.reused(opt, groups, prev is None)
    if reused is not None:  # adaptive_coefficients_interval > 1: the last coefficients, no model value
        w, value = reused, math.nan
        ada.recorder.activations = None  # no J·v at this step: the forward's activations are not needed
    else:
        try:
            w, value, base, fixed = ada.coefficients(opt, params, groups, deltas, vecs, prev, targets)
        except ValueError as err:
            if "positive definite" not in str(err):
                raise
            if not any(bool(v.any()) for v in vecs):  # a zero gradient (a batch fitted exactly): no step, as
                _forget_previous_update(states)       # after a zero-loss batch, and no skip
                ada.last = {"learning_rate": 0.0, "momentum": 0.0, "quad_model": 0.0, "steps": ada.last["steps"] + 1}
                return 0.0
            half = params[0].dtype in (torch.float16, torch.bfloat16)
            why = (" (the products J·v of the quadratic model overflowed in the parameters' "
                   f"{str(params[0].dtype).replace('torch.', '')}: run the model in float32 under autocast, or "
                   "in bfloat16)") if half and "nan" in str(err) else ""
            logger.warning("step %d: %s%s; no update", opt.num_steps, err, why)
            # finite entries: negative curvature along the step; NaN/inf ones (a non-finite gradient at a step
            # that does not check it, an overflow: `why`) fail the same test and are a non-finite step
            ada.no_minimum = ada.model_finite
            return None
        if loss is not None:
            objective = loss + decay_term(params, wds)
            w, value = within_objective(w, value, objective, fixed, base)
    alpha, mu = w[0], (w[1] if len(w) > 1 else 0.0)
    if not all(math.isfinite(x) for x in (alpha, mu)) or (reused is None and not math.isfinite(value)):
        return None
    with torch.no_grad():  # the same element-wise products as a loop over the tensors, in fewer calls
        new = torch._foreach_mul(list(deltas), _foreach_scalar(alpha, deltas))  # new tensors of this step
        if prev is not None:
            torch._foreach_add_(new, prev, alpha=mu)
        if not owned_all_finite(new):
            return None
        if all(p.dtype == t.dtype for p, t in zip(params, new)):
            torch._foreach_add_(params, new)
        else:
            for p, t in zip(params, new):
                p.add_(t.to(p.dtype))
        if alpha == 0.0 and (prev is None or mu == 0.0):  # no update (a batch whose loss is 0: t = 0)
            _forget_previous_update(states)
        else:
            for s, t in zip(states, new):
                s["adaptive_delta"] = t
    ada.last = {"learning_rate": -alpha, "momentum": mu, "quad_model": value, "steps": ada.last["steps"] + 1}
    logger.debug("adaptive step: learning_rate=%.4g momentum=%.4g M=%.4g", -alpha, mu, value)
    return value
