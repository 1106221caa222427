"""Predictive-quality metrics for (Bayesian) classifiers.

All functions take *probabilities* (not logits): ``probs`` is a floating-point
tensor of shape ``[N, C]`` whose rows are non-negative and sum to one (within
``1e-2``: a float16 or bfloat16 softmax cast to float32 is off by up to ~3e-3), and ``targets`` is a ``torch.long`` tensor of shape ``[N]`` with
values in ``[0, C)``.  Scalar metrics are returned as Python ``float`` and are
computed in float64 without tracking gradients.

Calibration follows Guo et al., "On Calibration of Modern Neural Networks"
(ICML 2017): the confidence of an example is its maximum predicted probability
and the unit interval is split into ``n_bins`` equal-width, right-inclusive
bins ``(0, 1/n], (1/n, 2/n], ..., ((n-1)/n, 1]``.  A confidence exactly equal
to an edge ``k/n`` (as represented in the dtype of ``probs``) falls into the
bin that edge closes, i.e. bin ``k - 1``.

Example::

    probs = torch.softmax(model(x), dim=-1)            # [N, C]
    metrics.evaluate(probs, y)                          # {"accuracy", "nll", "ece", "brier"}

    # Bayesian model average over S posterior samples
    prob_samples = torch.stack([torch.softmax(m(x), -1) for m in samples])  # [S, N, C]
    metrics.evaluate(metrics.bayesian_model_average(prob_samples), y)
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Dict

import torch
from torch import Tensor

__all__ = [
    "ReliabilityData",
    "accuracy",
    "bayesian_model_average",
    "brier",
    "ece",
    "evaluate",
    "nll",
    "predictive_entropy",
    "reliability_diagram_data",
]

#: Tolerance on ``|sum_c probs[n, c] - 1|`` accepted by the input validation, whatever the dtype: a float16
#: softmax sums to 1 within ~3e-4 and a bfloat16 one within ~3e-3, and they stay so when cast to float32 or
#: float64 for evaluation; logits and unnormalised scores are off by far more.
ROW_SUM_ATOL = 1e-2
#: a row off by more than this is not probabilities at all (logits, scores): the message says so; below it,
#: to renormalise
RENORMALISE_BELOW = 0.05


# --------------------------------------------------------------------------- #
# Validation helpers
# --------------------------------------------------------------------------- #
def _check_probs(probs: object, name: str = "probs") -> Tensor:
    """Validate a ``[N, C]`` probability tensor and return it unchanged."""
    if not isinstance(probs, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [N, C], got {type(probs).__name__}")
    if not probs.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {probs.dtype}")
    if probs.dim() != 2:
        raise ValueError(f"{name} must be 2-D with shape [N, C], got shape {tuple(probs.shape)}")
    n, c = probs.shape
    if n < 1 or c < 1:
        raise ValueError(f"{name} must have at least one example and one class, got shape {tuple(probs.shape)}")
    with torch.no_grad():  # checked on the tensor itself: no float64 copy of a large [N, C]
        p = probs.detach()
        finite = torch.isfinite(p)
        if not bool(finite.all()):
            idx = (~finite).nonzero()[0]
            raise ValueError(f"{name} must be finite, but {name}[{int(idx[0])}, {int(idx[1])}] = "
                             f"{float(p[idx[0], idx[1]])}")
        if bool((p < 0).any()):
            idx = (p < 0).nonzero()[0]
            raise ValueError(
                f"{name} must be non-negative, but {name}[{int(idx[0])}, {int(idx[1])}] = "
                f"{float(p[idx[0], idx[1]])}"
            )
        dev = (p.sum(dim=1, dtype=torch.float64) - 1.0).abs()
        if bool((dev > ROW_SUM_ATOL).any()):
            bad = int(dev.argmax())
            total = float(p[bad].sum(dtype=torch.float64))
            advice = ("renormalise them (probs / probs.sum(-1, keepdim=True))" if float(dev[bad]) < RENORMALISE_BELOW
                      else "pass probabilities (e.g. softmax(logits)), not logits")
            raise ValueError(f"rows of {name} must sum to 1 (within {ROW_SUM_ATOL:g}), but row {bad} sums to "
                             f"{total}; {advice}")
    return probs


def _check_targets(targets: object, probs: Tensor) -> Tensor:
    """Validate a ``[N]`` long tensor of class indices in ``[0, C)`` matching ``probs``."""
    n, c = probs.shape
    if not isinstance(targets, Tensor):
        raise TypeError(f"targets must be a torch.Tensor of shape [N], got {type(targets).__name__}")
    if targets.dtype != torch.long:
        raise TypeError(f"targets must have dtype torch.long (int64), got {targets.dtype}")
    if targets.dim() != 1:
        raise ValueError(f"targets must be 1-D with shape [N], got shape {tuple(targets.shape)}")
    if targets.shape[0] != n:
        raise ValueError(f"targets must have length N={n} to match probs {tuple(probs.shape)}, got {targets.shape[0]}")
    if targets.device != probs.device:
        raise ValueError(f"targets is on {targets.device} but probs is on {probs.device}; expected the same device")
    lo, hi = int(targets.min()), int(targets.max())
    if lo < 0 or hi >= c:
        bad = lo if lo < 0 else hi
        raise ValueError(f"targets must be class indices in [0, {c}), got value {bad}")
    return targets


def _check_n_bins(n_bins: object) -> int:
    """Validate ``n_bins`` as a positive Python/NumPy integer (bools rejected)."""
    if isinstance(n_bins, bool) or not hasattr(n_bins, "__index__"):
        raise TypeError(f"n_bins must be an int >= 1, got {n_bins!r} ({type(n_bins).__name__})")
    n_bins = int(n_bins.__index__())
    if n_bins < 1:
        raise ValueError(f"n_bins must be an int >= 1, got {n_bins}")
    return n_bins


def _check_eps(eps: object) -> float:
    """Validate the log-clamping constant ``eps`` (finite, ``0 <= eps < 1``)."""
    if isinstance(eps, Tensor) and eps.numel() == 1 and not eps.is_complex():
        eps = eps.item()  # a one-element tensor: its number
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):  # a NumPy scalar is a number too
        raise TypeError(f"eps must be a float in [0, 1), got {eps!r} ({type(eps).__name__})")
    eps = float(eps)
    if not (0.0 <= eps < 1.0):
        raise ValueError(f"eps must be a float in [0, 1), got {eps}")
    return eps


# --------------------------------------------------------------------------- #
# Scalar metrics
# --------------------------------------------------------------------------- #
def nll(probs: Tensor, targets: Tensor, eps: float = 1e-12) -> float:
    """Mean negative log predictive probability of the true class.

    ``-(1/N) Σ_n log max(probs[n, targets[n]], eps)``

    Args:
        probs: ``[N, C]`` predictive probabilities.
        targets: ``[N]`` long class indices.
        eps: lower clamp on the probability before the log, so a zero
            probability on the true class gives ``-log(eps)`` instead of ``inf``.
            ``eps=0`` disables clamping.

    Returns:
        The mean NLL in nats (a Python float, ``>= 0``).
    """
    probs = _check_probs(probs)
    return _nll(probs, _check_targets(targets, probs), _check_eps(eps))


def _nll(probs: Tensor, targets: Tensor, eps: float) -> float:
    with torch.no_grad():
        p_true = probs.detach().gather(1, targets.unsqueeze(1)).squeeze(1).to(torch.float64)
        return float(-torch.log(p_true.clamp_min(eps)).mean()) + 0.0  # (+ 0.0: no "-0.0" when every p is 1)


def accuracy(probs: Tensor, targets: Tensor) -> float:
    """Fraction of examples whose arg-max class equals the target.

    Ties are broken towards the lowest class index (``torch.argmax``).

    Args:
        probs: ``[N, C]`` predictive probabilities.
        targets: ``[N]`` long class indices.

    Returns:
        Accuracy in ``[0, 1]`` (a Python float).
    """
    probs = _check_probs(probs)
    return _accuracy(probs, _check_targets(targets, probs))


def _accuracy(probs: Tensor, targets: Tensor) -> float:
    with torch.no_grad():
        return float((probs.detach().argmax(dim=1) == targets).to(torch.float64).mean())


def brier(probs: Tensor, targets: Tensor) -> float:
    """Multi-class Brier score ``(1/N) Σ_n Σ_c (probs[n, c] - onehot(targets[n])_c)^2``.

    Args:
        probs: ``[N, C]`` predictive probabilities.
        targets: ``[N]`` long class indices.

    Returns:
        The Brier score in ``[0, 2]`` (a Python float; 0 is perfect).
    """
    probs = _check_probs(probs)
    return _brier(probs, _check_targets(targets, probs))


#: rows of a [N, C] table squared in float64 at a time by :func:`brier` (bounded memory, float64 squares)
_BRIER_CHUNK_ELEMENTS = 1 << 22


def _brier(probs: Tensor, targets: Tensor) -> float:
    with torch.no_grad():  # Σ_c p² − 2 p_y + 1 per row, without a one-hot [N, C]; squared in float64, in row chunks
        p = probs.detach()
        rows = max(1, _BRIER_CHUNK_ELEMENTS // max(1, p.shape[1]))
        squares = torch.cat([p[i:i + rows].to(torch.float64).pow(2).sum(dim=1) for i in range(0, p.shape[0], rows)])
        p_true = p.gather(1, targets.unsqueeze(1)).squeeze(1).to(torch.float64)
        return float((squares - 2.0 * p_true + 1.0).mean())


# --------------------------------------------------------------------------- #
# Calibration
# --------------------------------------------------------------------------- #
@dataclass(frozen=True)
class ReliabilityData:
    """Per-bin statistics of a reliability diagram (all float64/int64 CPU tensors).

    Attributes:
        bin_edges: ``[n_bins + 1]`` edges ``0, 1/n, ..., 1``; bin ``b`` is
            ``(bin_edges[b], bin_edges[b + 1]]``.
        bin_confidence: ``[n_bins]`` mean max-probability of the examples in
            each bin (NaN for an empty bin).
        bin_accuracy: ``[n_bins]`` fraction of correct arg-max predictions in
            each bin (NaN for an empty bin).
        bin_count: ``[n_bins]`` number of examples in each bin (int64).
    """

    bin_edges: Tensor
    bin_confidence: Tensor
    bin_accuracy: Tensor
    bin_count: Tensor

    @property
    def n_bins(self) -> int:
        """Number of bins."""
        return int(self.bin_count.numel())

    @property
    def n_examples(self) -> int:
        """Total number of examples ``N`` (sum of ``bin_count``)."""
        return int(self.bin_count.sum())

    @property
    def ece(self) -> float:
        """Expected calibration error ``Σ_b (|B_b| / N) |acc_b - conf_b|`` (empty bins skipped)."""
        nonempty = self.bin_count > 0
        weights = self.bin_count[nonempty].to(torch.float64) / self.n_examples
        gaps = (self.bin_accuracy[nonempty] - self.bin_confidence[nonempty]).abs()
        return float((weights * gaps).sum())


def reliability_diagram_data(probs: Tensor, targets: Tensor, n_bins: int = 15) -> ReliabilityData:
    """Bin examples by confidence (max probability) into equal-width, right-inclusive bins.

    Bin ``b`` (0-based) is ``(b / n_bins, (b + 1) / n_bins]``, compared in
    float64; a confidence exactly equal to an edge in the dtype of ``probs``
    (``float32(0.1)`` for the edge 0.1) goes to the bin that edge closes. Where
    fine bins make several edges round to one value of a low-precision dtype
    (bfloat16 near 1 with 1000 bins), that value is compared in float64; a
    confidence off the edges always lands between its bin's edges.

    Args:
        probs: ``[N, C]`` predictive probabilities.
        targets: ``[N]`` long class indices.
        n_bins: number of bins (``>= 1``).

    Returns:
        A :class:`ReliabilityData` with tensors of shape ``[n_bins + 1]``
        (edges) and ``[n_bins]`` (confidence, accuracy, count), on the CPU.
    """
    probs = _check_probs(probs)
    return _reliability(probs, _check_targets(targets, probs), _check_n_bins(n_bins))


def _reliability(probs: Tensor, targets: Tensor, n_bins: int) -> ReliabilityData:
    with torch.no_grad():
        p = probs.detach().cpu()
        t = targets.cpu()
        conf, pred = p.max(dim=1)
        correct = (pred == t).to(torch.float64)
        # Correctly rounded k / n_bins in float64; right=False: index i satisfies
        # inner[i-1] < conf <= inner[i] -> (lo, hi] bins, compared exactly in float64.
        edges64 = torch.arange(n_bins + 1, dtype=torch.float64) / n_bins
        idx = torch.bucketize(conf.to(torch.float64), edges64[1:-1], right=False)
        # a confidence equal to an edge rounded to its own dtype is on that edge: the bin it closes, where
        # that rounded value belongs to one edge only (several edges rounding to one value leave it in
        # float64's bin)
        inner = edges64[1:-1].to(conf.dtype)
        values, counts = torch.unique(inner, return_counts=True)
        # (in float32, which holds every half-precision value: older torch has no CPU isin for half precision)
        tie = torch.isin(conf.to(torch.float32), values[counts == 1].to(torch.float32))
        if bool(tie.any()):
            idx = torch.where(tie, torch.bucketize(conf, inner, right=False), idx)
        count = torch.bincount(idx, minlength=n_bins)
        conf_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, conf.to(torch.float64))
        corr_sum = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, correct)
        denom = count.to(torch.float64)
        nan = torch.full((n_bins,), math.nan, dtype=torch.float64)
        nonempty = count > 0
        bin_conf = torch.where(nonempty, conf_sum / denom.clamp_min(1.0), nan)
        bin_acc = torch.where(nonempty, corr_sum / denom.clamp_min(1.0), nan)
    return ReliabilityData(bin_edges=edges64, bin_confidence=bin_conf, bin_accuracy=bin_acc, bin_count=count)


def ece(probs: Tensor, targets: Tensor, n_bins: int = 15) -> float:
    """Expected calibration error (Guo et al. 2017).

    ``ECE = Σ_b (|B_b| / N) |acc(B_b) - conf(B_b)|`` over equal-width,
    right-inclusive confidence bins on the max probability; empty bins
    contribute nothing.  See :func:`reliability_diagram_data` for the binning.

    Args:
        probs: ``[N, C]`` predictive probabilities.
        targets: ``[N]`` long class indices.
        n_bins: number of bins (``>= 1``).

    Returns:
        ECE in ``[0, 1]`` (a Python float).
    """
    return reliability_diagram_data(probs, targets, n_bins).ece


# --------------------------------------------------------------------------- #
# Tensor-valued helpers
# --------------------------------------------------------------------------- #
def predictive_entropy(probs: Tensor) -> Tensor:
    """Shannon entropy (nats) of each predictive distribution, with ``0 log 0 = 0``.

    Args:
        probs: ``[N, C]`` predictive probabilities.

    Returns:
        ``[N]`` tensor of entropies in ``[0, log C]`` (up to the rounding of ``probs``' dtype) with the
        dtype and device of ``probs`` (differentiable where ``probs > 0``).
    """
    probs = _check_probs(probs)
    return torch.special.entr(probs).sum(dim=1)


def bayesian_model_average(prob_samples: Tensor) -> Tensor:
    """Bayesian model average: the mean of the predictive distributions over samples.

    ``p(y | x) ≈ (1/S) Σ_s p(y | x, θ_s)``, averaging *probabilities* (not
    logits).

    Args:
        prob_samples: ``[S, N, C]`` predictive probabilities of ``S`` posterior
            samples; every ``[N, C]`` slice must be a valid probability table.

    Returns:
        ``[N, C]`` averaged probabilities (dtype and device of the input).
    """
    if not isinstance(prob_samples, Tensor):
        raise TypeError(
            f"prob_samples must be a torch.Tensor of shape [S, N, C], got {type(prob_samples).__name__}"
        )
    if prob_samples.dim() != 3:
        raise ValueError(f"prob_samples must be 3-D with shape [S, N, C], got shape {tuple(prob_samples.shape)}")
    if prob_samples.shape[0] < 1:
        raise ValueError(f"prob_samples must contain at least one sample (S >= 1), got shape {tuple(prob_samples.shape)}")
    s, n, c = prob_samples.shape
    _check_probs(prob_samples.reshape(s * n, c), name="prob_samples (flattened to [S*N, C])")
    return prob_samples.mean(dim=0)


def evaluate(probs: Tensor, targets: Tensor, n_bins: int = 15) -> Dict[str, float]:
    """All scalar metrics at once.

    Args:
        probs: ``[N, C]`` predictive probabilities.
        targets: ``[N]`` long class indices.
        n_bins: number of ECE bins (``>= 1``).

    Returns:
        ``{"accuracy": float, "nll": float, "ece": float, "brier": float}``.
    """
    n_bins = _check_n_bins(n_bins)
    probs = _check_probs(probs)  # validated once for the four
    targets = _check_targets(targets, probs)
    return {
        "accuracy": _accuracy(probs, targets),
        "nll": _nll(probs, targets, 1e-12),
        "ece": _reliability(probs, targets, n_bins).ece,
        "brier": _brier(probs, targets),
    }
