"""Likelihoods: per-example NLL, label sampling, and the square root of the output Hessian.

Conventions (all per example ``n``; the loss of a batch is the MEAN over examples):

* categorical (``cross_entropy``): ``ℓ_n = -log softmax(f_n)[y_n]``, outputs ``f`` of shape
  ``[N, C]`` (logits), targets ``[N]`` integer class indices. Sequence logits ``[N, T, C]`` (class
  dimension last) with targets ``[N, T]`` are the ``N·T`` rows ``[N·T, C]`` (:func:`as_rows`): the
  loss is the mean over every position, as ``F.cross_entropy(f.reshape(-1, C), y.reshape(-1))``.
* Gaussian with unit variance (``mse``): ``ℓ_n = ½‖y_n − f_n‖²``, outputs ``[N, D]`` (or
  ``[N]``), targets of the same shape.
* independent Bernoullis on logits (``binary_cross_entropy``): ``ℓ_n = Σ_d BCE(f_nd, y_nd)``, the sum over
  an example's output entries of ``F.binary_cross_entropy_with_logits``; outputs ``[N]`` or ``[N, ...]``
  (one logit per label: a binary classifier ``[N]`` / ``[N, 1]``, multi-label ``[N, D]``, a per-pixel mask),
  targets of the same shape with values in ``[0, 1]`` (soft labels allowed). With one logit per example the
  mean over the batch is ``F.binary_cross_entropy_with_logits(f, y)``; with ``D`` it is ``D×`` that (whose
  default reduction also averages over the labels).

Every quantity the engine needs from a likelihood is a set of *output-space vectors*
``v[k, n]`` (shape ``[K, N, *out]``) such that the curvature of interest is
``(1/N) Σ_n Σ_k (J_nᵀ v_kn)(J_nᵀ v_kn)ᵀ`` with ``J_n = ∂f_n/∂θ``.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .linalg.checks import all_finite
from .options import Kind, LossType

#: what ``loss="binary_cross_entropy"`` targets may hold (PyTorch's losses take floating targets; labels held
#: as integers or booleans, 0 and 1, are taken too and used in the output's dtype)
BINARY_TARGET_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def check_targets(targets: object) -> None:
    """``targets`` given to ``compute`` or ``step(closure, targets=...)``: a Tensor or None (TypeError
    naming what was given)."""
    if targets is not None and not isinstance(targets, Tensor):
        raise TypeError(f"targets must be a Tensor (class indices [N], binary labels or regression targets) or None, got "
                        f"{type(targets).__name__} {targets!r}"[:300])


def check_outputs_targets(loss: LossType, outputs: Tensor, targets: Optional[Tensor]) -> None:
    """Validate the shapes of ``outputs`` and ``targets``; ValueError naming the mismatch."""
    if not isinstance(outputs, Tensor):
        raise TypeError(f"the model output must be a Tensor, got {type(outputs).__name__}")
    check_targets(targets)
    if targets is not None and targets.device != outputs.device:
        raise ValueError(f"targets are on device {targets.device}, the model output on {outputs.device}: move the "
                         f"targets to the output's device (targets.to({str(outputs.device)!r}))")
    if loss is LossType.CROSS_ENTROPY:
        if outputs.dim() < 2:
            raise ValueError(
                f"loss='cross_entropy' expects model outputs (logits) of shape [N, C] (or [N, T, C] for sequences, "
                f"classes last), got {tuple(outputs.shape)}")
        if outputs.shape[-1] == 1:
            raise ValueError(
                f"loss='cross_entropy' got logits of shape {tuple(outputs.shape)} with one class: a softmax over one "
                "logit is constant, so its Fisher is zero. For a binary classifier trained with "
                "F.binary_cross_entropy_with_logits, pass loss='binary_cross_entropy' (a Bernoulli likelihood on "
                "each logit); for another loss of one output, take its curvature from your own backward (the "
                "optimizers' curvature='empirical_fisher' without targets); for a regression output, pass loss='mse'")
        if targets is None:
            return
        if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise ValueError(f"loss='cross_entropy' expects integer class targets, got dtype {targets.dtype}"
                             + ("; class-probability (soft-label) targets are not taken: 'fisher' and 'fisher_mc' need "
                                "no targets (the model's own likelihood)" if targets.is_floating_point() else ""))
        if targets.shape != outputs.shape[:-1]:
            what = "[N]" if outputs.dim() == 2 else "[N, T] (the logits' shape without the classes)"
            torch_layout = outputs.dim() > 2 and targets.shape == outputs.shape[:1] + outputs.shape[2:]
            raise ValueError(f"loss='cross_entropy' expects targets of shape {what}={tuple(outputs.shape[:-1])} "
                             f"for logits {tuple(outputs.shape)}, got {tuple(targets.shape)}"
                             + ("; these are F.cross_entropy's layout with the classes at dim 1, and the curvature "
                                "takes the classes last: pass output_selector=lambda out: out.movedim(1, -1)"
                                if torch_layout else ""))
        if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= outputs.shape[-1]):
            low = int(targets.min())
            raise ValueError(
                f"targets must be class indices in [0, {outputs.shape[-1]}), got range "
                f"[{low}, {int(targets.max())}]" + (
                    "; ignored positions (ignore_index, e.g. -100 padding) have no likelihood: select the valid "
                    "rows, output_selector=lambda out: out[mask] with targets=y[mask] (README, sequence outputs)"
                    if low < 0 else ""))
    elif loss is LossType.BINARY_CROSS_ENTROPY:
        _check_binary(outputs, targets)
    else:
        if outputs.dim() < 1:
            raise ValueError("loss='mse' expects outputs of shape [N, ...], got a scalar")
        if targets is not None and targets.shape != outputs.shape:
            raise ValueError(
                f"loss='mse' expects targets of the output's shape {tuple(outputs.shape)}, got {tuple(targets.shape)} "
                "(the model's output, or output_selector's pick of it: where the loss reads a reshaped output, "
                "out.squeeze(-1), pass output_selector=lambda out: out.squeeze(-1) or targets of the output's shape)")


def _check_binary(outputs: Tensor, targets: Optional[Tensor]) -> None:
    """:func:`check_outputs_targets` for ``loss='binary_cross_entropy'``: logits ``[N, ...]``, targets of their
    shape with values in ``[0, 1]``."""
    if outputs.dim() < 1:
        raise ValueError("loss='binary_cross_entropy' expects logits of shape [N] or [N, ...], got a scalar")
    if not outputs.is_floating_point():
        raise ValueError(f"loss='binary_cross_entropy' expects floating-point logits, got dtype {outputs.dtype}")
    if targets is None:
        return
    if targets.shape != outputs.shape:
        hint = ""
        if targets.shape == outputs.shape[:-1] and outputs.shape[-1] == 1:
            hint = ("; for logits [N, 1] pass targets y.unsqueeze(-1) (or select the logit: "
                    "output_selector=lambda out: out.squeeze(-1))")
        elif outputs.dim() >= 2 and targets.shape == outputs.shape[:1] and not targets.is_floating_point():
            hint = ("; these look like class indices: for one-of-C classes use loss='cross_entropy', for C independent "
                    "labels pass their 0/1 indicators [N, C]")
        raise ValueError(f"loss='binary_cross_entropy' expects targets of the logits' shape {tuple(outputs.shape)}, got "
                         f"{tuple(targets.shape)}{hint}")
    if not (targets.is_floating_point() or targets.dtype in BINARY_TARGET_DTYPES):
        raise ValueError(f"loss='binary_cross_entropy' expects targets in [0, 1] (floating, integer or bool), got dtype "
                         f"{targets.dtype}")
    if targets.numel() and targets.dtype is not torch.bool:
        inside = (targets >= 0) & (targets <= 1)  # False for NaN too
        if not bool(inside.all()):
            bad = targets[~inside].reshape(-1)[0].item()
            raise ValueError(f"loss='binary_cross_entropy' expects targets in [0, 1] (the probability of label 1), got "
                             f"{bad!r}" + ("; for labels -1/+1 pass (y + 1) / 2" if bad == -1 else ""))


def as_rows(loss: LossType, outputs: Tensor, targets: Optional[Tensor]) -> Tuple[Tensor, Optional[Tensor]]:
    """Cross-entropy sequence logits ``[N, T, C]`` and targets ``[N, T]`` as the ``N·T`` loss rows
    ``[N·T, C]`` / ``[N·T]`` (views, still in the graph); everything else unchanged."""
    if loss is not LossType.CROSS_ENTROPY or outputs.dim() <= 2:
        return outputs, targets
    return outputs.reshape(-1, outputs.shape[-1]), None if targets is None else targets.reshape(-1)


def loss_rows(loss: LossType, outputs: Tensor) -> int:
    """The number of rows the loss averages over: ``N``, or ``N·T`` for cross-entropy logits ``[N, T, C]``."""
    if loss is LossType.CROSS_ENTROPY and outputs.dim() > 2:
        return outputs.numel() // outputs.shape[-1] if outputs.shape[-1] else 0
    return outputs.shape[0]


def per_example_nll(loss: LossType, outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-example negative log-likelihood, shape ``[N]`` (``[N·T]``, one per row, for cross-entropy
    logits ``[N, T, C]``)."""
    outputs, targets = as_rows(loss, outputs, targets)
    if loss is LossType.CROSS_ENTROPY:
        return F.cross_entropy(outputs, targets.long(), reduction="none")
    if loss is LossType.BINARY_CROSS_ENTROPY:
        bce = F.binary_cross_entropy_with_logits(outputs, targets.to(outputs.dtype), reduction="none")
        return bce.reshape(outputs.shape[0], -1).sum(dim=1)
    diff = (outputs - targets).reshape(outputs.shape[0], -1)
    return 0.5 * diff.pow(2).sum(dim=1)


def mean_nll(loss: LossType, outputs: Tensor, targets: Tensor) -> Tensor:
    """Mean negative log-likelihood over the batch (a scalar): the loss ``L`` whose curvature we take."""
    return per_example_nll(loss, outputs, targets).mean()


def nll_grad(loss: LossType, outputs: Tensor, targets: Tensor) -> Tensor:
    """``∇_f ℓ_n`` for every example, shape of ``outputs`` (no autograd involved)."""
    f = outputs.detach()
    if loss is LossType.CROSS_ENTROPY:
        return class_softmax(f, 1) - F.one_hot(targets.long(), f.shape[1]).to(f.dtype)
    if loss is LossType.BINARY_CROSS_ENTROPY:
        return torch.sigmoid(f) - targets.to(f.dtype)
    return f - targets.to(f.dtype)


#: fewer classes than this take :func:`class_softmax`'s leading-dimension kernel on CPU
FEW_CLASSES = 16


def class_softmax(outputs: Tensor, dim: int) -> Tensor:
    """``softmax(outputs, dim)``; on CPU with fewer than :data:`FEW_CLASSES` classes by torch's
    kernel over a leading dimension (of ``outputs.movedim(dim, 0)``, a view): its last-dimension
    kernel has no vector path for so few classes (digits logits [128, 10]: ~23 µs, against ~5 µs,
    ~2 µs when the logits are stored class-major). The same values up to rounding (the order of
    the sum over the classes)."""
    if outputs.device.type == "cpu" and outputs.shape[dim] < FEW_CLASSES:
        return torch.softmax(outputs.movedim(dim, 0), 0).movedim(0, dim)
    return torch.softmax(outputs, dim)


def draw_classes(probs: Tensor, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """``num_samples`` classes per row of ``probs [N, C]`` (each row a distribution), drawn with
    replacement: ``[N, S]`` int64, distributed as ``torch.multinomial(probs, S, replacement=True)``.

    By the inverse of each row's CDF: one uniform ``u`` per draw (``torch.rand(N, S)`` of
    ``generator`` in float64, whatever the dtype of ``probs``, so a seeded generator gives the same
    classes to a float32 or half model as to its float64 copy, up to the rounding of ``probs``) and
    the first class whose cumulative probability (in float64) exceeds ``u``
    (``torch.searchsorted(..., right=True)``: a class of probability 0 is never drawn; rounding
    that leaves the last cumulative value below ``u`` gives the last class). On CPU ~4× faster
    than ``torch.multinomial`` for a fisher_mc batch (digits [128, 10]: ~11 µs against ~45 µs),
    and ``fisher_mc`` draws at every curvature step."""
    cdf = probs.to(torch.float64).cumsum(1)
    u = torch.rand(probs.shape[0], num_samples, generator=generator, dtype=torch.float64, device=probs.device)
    return torch.searchsorted(cdf, u, right=True).clamp_(max=probs.shape[1] - 1)


def sample_targets(loss: LossType, outputs: Tensor, num_samples: int,
                   generator: Optional[torch.Generator] = None) -> Tensor:
    """Draw ``num_samples`` labels per example from the model's predictive ``p(y | f_n)``.

    Returns ``[S, N]`` class indices (categorical) or ``[S, *outputs.shape]`` (Gaussian; Bernoulli: 0/1 in the
    output's dtype, :func:`draw_binary`).
    """
    f = outputs.detach()
    if loss is LossType.CROSS_ENTROPY:
        probs = class_softmax(f.to(torch.float64 if f.dtype == torch.float64 else torch.float32), 1)
        return draw_classes(probs, num_samples, generator).t().contiguous()
    if loss is LossType.BINARY_CROSS_ENTROPY:
        return draw_binary(_binary_probs(f), num_samples, generator).to(f.dtype)
    # the noise in float64 whatever the model's dtype (as the categorical draws): the same seed draws the
    # same numbers for a float32 model and its float64 copy
    noise = torch.randn((num_samples,) + tuple(f.shape), generator=generator, dtype=torch.float64, device=f.device)
    return f.unsqueeze(0) + noise.to(f.dtype)


def _binary_probs(f: Tensor) -> Tensor:
    """``sigmoid(f)`` of detached logits, in float32 at least (the draws compare it with float64 uniforms)."""
    return torch.sigmoid(f if f.dtype in (torch.float32, torch.float64) else f.to(torch.float32))


def bernoulli_std(f: Tensor) -> Tensor:
    """``√(p(1 − p))``, ``p = sigmoid(f)``, of detached logits: the standard deviation of each label, the square root
    of the Bernoulli output Hessian's diagonal. As ``√(σ(f)·σ(−f))``: no cancellation where ``p`` is near 1."""
    return (torch.sigmoid(f) * torch.sigmoid(-f)).sqrt()


def draw_binary(probs: Tensor, num_samples: int, generator: Optional[torch.Generator] = None) -> Tensor:
    """``num_samples`` Bernoulli draws of every entry of ``probs``: ``[S, *probs.shape]`` bool, ``True`` where
    ``u < p`` for one uniform ``u`` per draw (``torch.rand`` of ``generator`` in float64, whatever the dtype of
    ``probs``, as :func:`draw_classes`: a seeded generator draws the same labels for a float32 model and its
    float64 copy, up to the rounding of ``probs``). A probability of 0 is never drawn, 1 always. The uniforms
    are drawn example-major (``[*probs.shape, S]``, as :func:`draw_classes`' ``[N, S]``), so a batch split into
    micro-batches in order draws the same labels as the whole batch."""
    u = torch.rand(tuple(probs.shape) + (num_samples,), generator=generator, dtype=torch.float64, device=probs.device)
    return u.movedim(-1, 0) < probs.to(torch.float64)


def sqrt_output_hessian(loss: LossType, outputs: Tensor) -> Tensor:
    """Columns ``S[k, n]`` with ``Σ_k S[k,n] S[k,n]ᵀ = ∂²ℓ_n/∂f_n²``; shape ``[K, N, *out]``.

    Categorical: ``H = diag(p) − p pᵀ`` has rank ``C − 1`` (``H 1 = 0``), and so does its factor
    (``K = C − 1``, one fewer backward pass than the symmetric root ``diag(√p) − p √pᵀ``):
    with ``s = √p`` (a unit vector), ``H = diag(s) (I − s sᵀ) diag(s)``; the Householder
    reflection ``R = I − v vᵀ / (1 + s_C)``, ``v = s + e_C``, maps ``s`` to ``−e_C``, so its
    first ``C − 1`` columns ``Q`` are an orthonormal basis of ``s⊥`` and ``M = diag(s) Q``:

        ``M[i, k] = s_k δ_ik − (p_i + s_C δ_iC) s_k / (1 + s_C)``,  ``k < C − 1``.

    ``1 + s_C ≥ 1``, so no cancellation for any ``p``. ``C = 1`` gives one zero column.
    Gaussian: ``H = I`` (K = number of output entries per example).
    Bernoulli: ``H = diag(p ⊙ (1 − p))``, ``p = sigmoid(f)``: column ``k`` is ``√(p_k (1 − p_k)) e_k`` (K = number
    of output entries per example; one for a binary classifier).
    """
    f = outputs.detach()
    if loss is LossType.CROSS_ENTROPY:
        c = f.shape[1]
        p = torch.softmax(f, dim=1)  # [N, C]
        if c == 1:
            return torch.zeros_like(p).unsqueeze(0)
        s = p.sqrt()
        s_last = s[:, -1:]  # [N, 1]
        u = p.clone()
        u[:, -1:] += s_last  # s ∘ v = p + s_C e_C
        sk = s[:, :-1]  # [N, C-1]
        m = (u / (1.0 + s_last)).unsqueeze(2) * (-sk).unsqueeze(1)  # [N, C(row), C-1(col k)]
        m[:, :-1, :] += torch.diag_embed(sk)
        return m.permute(2, 0, 1).contiguous()
    n = f.shape[0]
    d = f[0].numel() if n else int(math.prod(f.shape[1:]))
    eye = torch.eye(d, dtype=f.dtype, device=f.device)  # [K=d, d]
    if loss is LossType.BINARY_CROSS_ENTROPY:
        s = bernoulli_std(f).reshape(1, n, d)
        return (eye.unsqueeze(1) * s).reshape((d,) + tuple(f.shape))
    return eye.unsqueeze(1).expand(d, n, d).reshape((d,) + tuple(f.shape)).contiguous()


def backprop_vectors(loss: LossType, kind: Kind, outputs: Tensor, targets: Optional[Tensor],
                     mc_samples: int = 1, generator: Optional[torch.Generator] = None) -> Tensor:
    """The output-space vectors ``v[k, n]`` (shape ``[K, N, *out]``) for a Fisher-type kind.

    * ``fisher``: the square root of the output Hessian (exact Fisher = GGN).
    * ``fisher_mc``: ``∇_f ℓ(f_n, ỹ_s) / √S`` for ``S = mc_samples`` labels ``ỹ`` sampled from the model
      (Bernoulli: ``(p − ỹ_s)/√S`` with ``ỹ_s`` drawn as :func:`sample_targets` draws them).
    * ``empirical_fisher``: ``∇_f ℓ(f_n, y_n)`` with the given targets (K = 1).
    """
    if kind is Kind.FISHER:
        return sqrt_output_hessian(loss, outputs)
    if kind is Kind.FISHER_MC:
        if loss is LossType.CROSS_ENTROPY:
            return _categorical_mc_vectors(outputs, mc_samples, generator)
        if loss is LossType.BINARY_CROSS_ENTROPY:
            f = outputs.detach()
            p = _binary_probs(f)
            v = p.unsqueeze(0) - draw_binary(p, mc_samples, generator).to(p.dtype)  # [S, *out]: p − ỹ
            v = v if mc_samples == 1 else v.mul_(1.0 / math.sqrt(mc_samples))
            return v.to(f.dtype)
        # Gaussian: the gradient at ỹ = f + ε is −ε itself; formed from ε, not from f − ỹ (in half precision
        # f + ε rounds ε to f's ulp: a bfloat16 output near 300 made the estimate 31% off)
        noise = torch.randn((mc_samples,) + tuple(outputs.shape), generator=generator, dtype=torch.float64,
                            device=outputs.device)
        return noise.mul_(-1.0 / math.sqrt(mc_samples)).to(outputs.dtype)
    if kind is Kind.EMPIRICAL_FISHER:
        if targets is None:
            raise ValueError("kind='empirical_fisher' needs the true targets")
        return nll_grad(loss, outputs, targets).unsqueeze(0)
    raise ValueError(f"kind={kind.value!r} is not a Fisher-type kind")


def _categorical_mc_vectors(outputs: Tensor, samples: int, generator: Optional[torch.Generator]) -> Tensor:
    """``fisher_mc`` vectors of the categorical likelihood, ``[S, N, C]``: ``(softmax(f) − onehot(ỹ_s))/√S``
    with ``ỹ_s`` drawn as :func:`sample_targets` draws them (same generator stream, same numbers as
    :func:`nll_grad` at the drawn labels); the softmax is computed once for sampling and gradient."""
    f = outputs.detach()
    wide = f.dtype in (torch.float32, torch.float64)
    p = class_softmax(f if wide else f.to(torch.float32), 1)
    draws = draw_classes(p, samples, generator)  # [N, S]
    probs = p if wide else class_softmax(f, 1)
    # p − onehot(ỹ): p with 1 subtracted at the drawn class (p + (−1) is p − 1 exactly), in place of a
    # copy: no one-hot tensor, its cast and a subtraction over every class (digits [128, 10]: ~11 -> ~5 µs);
    # one sample needs no repeat: the softmax itself when contiguous (a new tensor, no longer needed once
    # drawn from), else one contiguous copy of it (class_softmax's class-major result for few classes)
    v = probs.unsqueeze(0).contiguous() if samples == 1 else probs.unsqueeze(0).repeat(samples, 1, 1)
    v.scatter_add_(2, draws.t().unsqueeze(2), v.new_full((samples, f.shape[0], 1), -1.0))
    return v if samples == 1 else v.mul_(1.0 / math.sqrt(samples))


def outputs_finite(loss: LossType, outputs: Tensor) -> bool:
    """Whether the model's ``outputs`` have no NaN/inf, except ``-inf`` in cross-entropy logits (a masked
    class, ``logits.masked_fill(mask, -inf)``: probability zero, a finite loss and curvature)."""
    if all_finite([outputs]):
        return True
    return loss is LossType.CROSS_ENTROPY and not bool((outputs.isnan() | outputs.isposinf()).any())
