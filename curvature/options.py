"""The option vocabularies of the curvature engine: kinds, shapes (approximations), likelihoods.

Strings are accepted at the public surface and converted here, once, into enums, so that
the rest of the engine never compares magic strings.
"""
from __future__ import annotations

import difflib
import math
import numbers
from enum import Enum
from typing import List, Type, TypeVar

E = TypeVar("E", bound=Enum)


class Kind(str, Enum):
    """Which curvature matrix.

    * ``FISHER``: the exact Fisher of the model's predictive, which for the supported
      likelihoods equals the generalized Gauss-Newton (GGN) ``(1/N) Σ_n J_nᵀ H_n J_n``.
    * ``FISHER_MC``: Monte-Carlo Fisher, labels sampled from the model's predictive.
    * ``EMPIRICAL_FISHER``: ``(1/N) Σ_n ∇ℓ_n ∇ℓ_nᵀ`` with the given (true) labels.
    * ``HESSIAN``: the exact Hessian of the mean loss.
    """

    FISHER = "fisher"
    FISHER_MC = "fisher_mc"
    EMPIRICAL_FISHER = "empirical_fisher"
    HESSIAN = "hessian"


class Approx(str, Enum):
    """Which approximation (shape) of a module's curvature block."""

    FULL = "full"
    DIAG = "diag"
    KFAC = "kfac"


class KFACApprox(str, Enum):
    """How K-FAC treats a weight-sharing dimension ``T`` (sequence positions, conv patches) of a
    Linear-like layer (Eschenhagen et al., NeurIPS 2023, "Kronecker-Factored Approximate Curvature
    for Modern Neural Network Architectures").

    * ``EXPAND``: every position is an example: ``A`` averages ``a_nt a_ntᵀ`` over all ``N·T``
      positions, ``G`` sums ``g_nt g_ntᵀ`` over positions (divided by the loss rows).
    * ``REDUCE``: each example's positions are reduced first: ``A`` averages ``ā_n ā_nᵀ`` with
      ``ā_n = (1/T) Σ_t a_nt``, ``G`` sums ``ĝ_n ĝ_nᵀ`` with ``ĝ_n = Σ_t g_nt`` (divided by the loss rows).
    """

    EXPAND = "expand"
    REDUCE = "reduce"


class LossType(str, Enum):
    """The likelihood: categorical on logits, unit-variance Gaussian, or independent Bernoullis on logits
    (:mod:`curvature.likelihoods`)."""

    CROSS_ENTROPY = "cross_entropy"
    MSE = "mse"
    BINARY_CROSS_ENTROPY = "binary_cross_entropy"


#: names other libraries use (PyTorch-SSO's ``curv_type`` and ``curv_shapes``, K-FAC spellings),
#: lower-cased, with the name they have here; only used to word the error for them
LEGACY_NAMES = {
    "Kind": {"cov": "'empirical_fisher'", "fisher": "'fisher_mc' (sampled labels) or 'fisher' (exact)",
             "fishermc": "'fisher_mc'", "fisherexact": "'fisher'", "hessian": "'hessian'", "ggn": "'fisher'",
             "empirical": "'empirical_fisher'", "ef": "'empirical_fisher'"},
    "Approx": {"kron": "'kfac'", "k-fac": "'kfac'", "kfac": "'kfac'", "diag": "'diag'", "diagonal": "'diag'",
               "full": "'full'", "": "'full'"},
}


def parse(enum_type: Type[E], value: object, what: str) -> E:
    """Convert a string (or enum member) into ``enum_type``, in any case (``"KFAC"``, ``"Diag"``, as the other
    choice arguments); ValueError naming the choices (and, for another library's name such as PyTorch-SSO's
    ``'Cov'`` or ``'Kron'``, the name here). PyTorch-SSO's ``'Fisher'`` is its Monte-Carlo Fisher, so a kind
    spelled ``fisher`` in another case is that error, not the exact Fisher."""
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        for member in enum_type:
            if member.value == value:
                return member
        ambiguous = enum_type.__name__ == "Kind" and value.lower() == "fisher"
        for member in enum_type:
            if member.value == value.lower() and not ambiguous:
                return member
    choices = ", ".join(repr(m.value) for m in enum_type)
    new = LEGACY_NAMES.get(enum_type.__name__, {}).get(value.lower()) if isinstance(value, str) else None
    if new is not None:
        raise ValueError(f"{what}={value!r} is another library's name (PyTorch-SSO's curv_type/curv_shapes, "
                         f"or a K-FAC spelling): here it is {new}; expected one of {choices} "
                         "(torchsso2.compat.pytorch_sso converts PyTorch-SSO's arguments)")
    raise ValueError(f"{what}={value!r} is not supported{did_you_mean(value, [m.value for m in enum_type])}; "
                     f"expected one of {choices}")


def check_generator(generator: object) -> None:
    """A ``generator`` argument: a ``torch.Generator`` or None (TypeError naming what was given)."""
    import torch

    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__} {generator!r}")


def check_mc_samples(mc_samples: object, kind: str, what: str = "kind", hint: str = "") -> int:
    """``mc_samples`` checked: an int >= 1, and above 1 only for the Monte-Carlo Fisher (with any other
    ``kind`` it would be accepted without effect). ``what`` names the argument the caller calls the
    kind; ``hint`` is appended to the second error."""
    if isinstance(mc_samples, bool) or not isinstance(mc_samples, numbers.Integral):
        raise TypeError(f"mc_samples must be an int >= 1, got {type(mc_samples).__name__} {mc_samples!r}")
    if mc_samples < 1:
        raise ValueError(f"mc_samples={mc_samples!r} is invalid; expected an int >= 1")
    mc_samples = int(mc_samples)
    if mc_samples != 1 and kind != Kind.FISHER_MC.value:
        raise ValueError(f"mc_samples={mc_samples!r} has no effect with {what}={kind!r}: it is the number of labels "
                         f"sampled per example for the Monte-Carlo Fisher ({what}='fisher_mc'){hint}")
    return mc_samples


def float_or_inf(value: "numbers.Real") -> float:
    """``float(value)``, and ``±inf`` for an int beyond the largest float (``10**400``: Python's
    ``OverflowError`` otherwise), so that a range check names the value."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def a_or_an(word: str) -> str:
    """The indefinite article for ``word`` (a name: "an AssignmentStrategy", "a ComputeMethod")."""
    return "an" if word[:1].upper() in "AEIOU" else "a"


def did_you_mean(value: object, choices: List[str]) -> str:
    """`` (did you mean 'x'?)`` for the valid names closest to ``value``, or ``""``."""
    close = close_matches(value, choices)
    return f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""


def close_matches(value: object, choices: List[str]) -> List[str]:
    """The valid names closest to ``value`` (``"fisher-mc"`` → ``["fisher_mc"]``)."""
    if not isinstance(value, str):
        return []
    normal = value.strip().lower().replace("-", "_").replace(" ", "_")
    if normal in choices:
        return [normal]
    return difflib.get_close_matches(normal, choices, n=2, cutoff=0.6)
