"""PyTorch-SSO's names and numbers -> torchsso2's (pure conversions, no optimizer state).

PyTorch-SSO (``torchsso``, github.com/cybertronai/pytorch-sso) conventions and how they map:

==========================  =====================================  ==========================================
PyTorch-SSO                 meaning there                          torchsso2
==========================  =====================================  ==========================================
``curv_type='Cov'``         empirical Fisher (true labels)         ``curvature='empirical_fisher'``
``curv_type='Fisher'``      ``fisher_args.approx_type='mc'``:      ``'fisher_mc'`` (``num_mc`` → ``mc_samples``),
                            sampled labels; otherwise exact        otherwise ``'fisher'``
``curv_type='Hessian'``     Hessian                                ``'hessian'``
``curv_shapes`` values      ``'Kron'``, ``'Diag'`` (absent: no     ``'kfac'``, ``'diag'``; absent: ``'full'``
                            working full shape)
``ema_decay`` β             weight of the *new* batch              ``ema_decay = 1 − β`` (weight of the old)
``damping`` λ (K-FAC)       ``√λ·π`` on A, ``√λ/π`` on G,          the same factored damping, reproduced by
                            π = √((tr A/d_A)/(tr G/d_G))           the compat optimizers (VI: λ + l2, per example)
``l2_reg``                  ``g + l2·θ`` *and* ``+ l2`` damping    ``weight_decay = l2`` and ``damping += l2``
``weight_decay``            decoupled: ``+ wd·θ`` after the solve, applied decoupled by the compat faces,
                            before a preconditioned-gradient       in the same place
                            momentum / EMA, after a raw one
``momentum`` (default 0)    heavy ball on preconditioned grads     ``momentum`` (native default 0.9)
VI ``damping``              per example                            × ``dataset_size``
VI ``init_precision``       per example, the curvature EMA's       the running curvature starts at
                            starting value; the prior's ``l2`` in  ``init_precision·I`` (per example), the
                            the damping is averaged in from 0      prior's share ramped in alike
VI ``prior_variance`` σ²    ``l2 = kl/(N σ²)``                      ``prior_variance = σ²``
``grad_ema_decay`` d        ``buf ← (1−d)·buf + d·g``              ``momentum = 1 − d``, ``lr × d`` in the
                                                                   step (the groups hold PyTorch-SSO's lr)
==========================  =====================================  ==========================================
"""
from __future__ import annotations

import logging
import math
from typing import Any, Dict, Mapping, Optional, Tuple

from torch import nn

from ..optim.validation import check_number

logger = logging.getLogger(__name__)

SHAPES = {"Kron": "kfac", "Diag": "diag", "": "full", "Full": "full"}
CURV_KWARGS = ("ema_decay", "damping", "use_max_ema", "use_sqrt_ema", "pi_type")
FISHER_KWARGS = ("approx_type", "num_mc")


def curvature_kind(curv_type: str, fisher_args: Optional[Mapping[str, Any]]) -> Tuple[str, int]:
    """``(torchsso2 curvature kind, mc_samples)`` of PyTorch-SSO's ``curv_type`` and ``fisher_args``."""
    fisher_args = dict(fisher_args or {})
    unknown = set(fisher_args) - set(FISHER_KWARGS)
    if unknown:
        raise TypeError(f"fisher_args: unknown keys {sorted(unknown)}; PyTorch-SSO's are {list(FISHER_KWARGS)}")
    if curv_type == "Cov":
        return "empirical_fisher", 1
    if curv_type == "Hessian":
        return "hessian", 1
    if curv_type == "Fisher":
        if fisher_args.get("approx_type") == "mc":
            num_mc = fisher_args.get("num_mc", 1)
            if not isinstance(num_mc, int) or isinstance(num_mc, bool) or num_mc < 1:
                raise ValueError(f"fisher_args['num_mc'] must be an int >= 1, got {num_mc!r}")
            return "fisher_mc", num_mc
        if fisher_args.get("approx_type") not in (None, "exact"):
            raise ValueError(f"fisher_args['approx_type']={fisher_args['approx_type']!r}; expected 'mc' or None")
        return "fisher", 1
    raise ValueError(f"curv_type={curv_type!r}; PyTorch-SSO's curvature types are 'Cov', 'Fisher' and 'Hessian'")


def check_hessian_shapes(kind: str, curv_shapes: Optional[Mapping[str, str]]) -> None:
    """NotImplementedError, in PyTorch-SSO's terms, for ``curv_type='Hessian'`` with a ``'Kron'`` shape."""
    kron = sorted(cls for cls, shape in dict(curv_shapes or {}).items() if shape == "Kron")
    if kind == "hessian" and kron:
        raise NotImplementedError(
            f"curv_type='Hessian' with curv_shapes 'Kron' for {kron}: K-FAC of the Hessian is not implemented in "
            "torchsso2; give those classes 'Diag' or leave them out of curv_shapes (a full block), or use "
            "curv_type 'Fisher' or 'Cov' with 'Kron'")


#: the most entries a full block may have that a class absent from ``curv_shapes`` implies (2²⁸: 1 GiB in
#: float32, a layer of 16,384 parameters); above it the compat classes refuse at construction
MAX_IMPLIED_FULL = 2 ** 28


def approx_map(model: Any, curv_shapes: Optional[Mapping[str, str]]) -> Dict[str, str]:
    """``approx`` dict by module class name: the given shapes converted, and ``'full'`` for every
    other class of a leaf module with parameters, ``nn.MultiheadAttention`` included (PyTorch-SSO's
    default when a class is absent)."""
    curv_shapes = dict(curv_shapes or {})
    present = {type(m).__name__ for m in model.modules()}
    out: Dict[str, str] = {}
    for cls, shape in curv_shapes.items():
        if shape not in SHAPES:
            raise ValueError(f"curv_shapes[{cls!r}]={shape!r}; PyTorch-SSO's shapes are 'Kron', 'Diag' (or absent: full)")
        if cls in present:  # PyTorch-SSO's configs list classes a model may not have (BatchNorm2d for an MLP)
            out[cls] = SHAPES[shape]
    for module in model.modules():
        # leaf modules, and nn.MultiheadAttention (its in-projection is its own parameters; out_proj a child)
        leaf = not list(module.children()) or isinstance(module, nn.MultiheadAttention)
        if leaf and any(True for _ in module.parameters(recurse=False)):
            out.setdefault(type(module).__name__, "full")
    return out


def check_implied_full(opt: Any, curv_shapes: Optional[Mapping[str, str]]) -> None:
    """ValueError for a covered module of ``opt`` (after ``skip_modules`` / ``params``) whose class is absent
    from ``curv_shapes`` and whose full block would have more than :data:`MAX_IMPLIED_FULL` entries (the
    first step would fail to allocate it), naming ``curv_shapes``."""
    given = set(curv_shapes or {})
    for name, lay in opt.engine.layouts.items():
        cls = type(lay.module).__name__
        numel = lay.numel
        if cls not in given and opt.engine.approx[name].value == "full" and numel ** 2 > MAX_IMPLIED_FULL:
            raise ValueError(
                f"curv_shapes has no entry for {cls!r}: a class absent from it gets a full block, and {cls} "
                f"{name!r} has {numel} parameters, a {numel}x{numel} block ({numel ** 2 * 4 / 2 ** 30:.3g} GiB in "
                f"float32); give curv_shapes[{cls!r}] = 'Kron' or 'Diag' (or leave the module out with "
                "skip_modules)")


def curvature_settings(curv_kwargs: Optional[Mapping[str, Any]]) -> Tuple[float, float, str]:
    """``(ema_decay here, damping there, pi_type)`` of PyTorch-SSO's ``curv_kwargs`` (its defaults:
    ``ema_decay=1``, ``damping=1e-7``). Options without an equivalent raise NotImplementedError."""
    kw = dict(curv_kwargs or {})
    unknown = set(kw) - set(CURV_KWARGS)
    if unknown:
        raise TypeError(f"curv_kwargs: unknown keys {sorted(unknown)}; PyTorch-SSO's are {list(CURV_KWARGS)}")
    if kw.get("use_max_ema", False):
        raise NotImplementedError("curv_kwargs use_max_ema=True (a running maximum of the curvature) has no "
                                  "equivalent in torchsso2")
    if kw.get("use_sqrt_ema", False):
        raise NotImplementedError("curv_kwargs use_sqrt_ema=True (the square root of the curvature EMA, Adam-like) "
                                  "has no equivalent in torchsso2")
    pi_type = kw.get("pi_type", "tracenorm")
    if pi_type != "tracenorm":
        raise ValueError(f"curv_kwargs pi_type={pi_type!r}; PyTorch-SSO only has 'tracenorm'")
    beta = check_number("curv_kwargs ema_decay", kw.get("ema_decay", 1.0))  # (a YAML '1e-3' is a string)
    if beta == 0.0:
        raise NotImplementedError(
            "curv_kwargs ema_decay=0 (PyTorch-SSO keeps the first batch's curvature for good) has no equivalent "
            "in the compat optimizers; to estimate the curvature once (at the first step) and keep it, pass "
            "curv_update_interval=<more than the run's steps> instead")
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"curv_kwargs ema_decay={beta!r}: PyTorch-SSO's ema_decay is the weight of the new batch, "
                         "in [0, 1]")
    damping = check_number("curv_kwargs damping", kw.get("damping", 1e-7))
    if not math.isfinite(damping) or damping < 0:
        raise ValueError(f"curv_kwargs damping={damping!r} must be a finite number >= 0")
    return 1.0 - beta, damping, pi_type


def momentum_settings(momentum: float, momentum_type: str, grad_ema_decay: float, grad_ema_type: str,
                      native: str) -> Tuple[float, float]:
    """``(lr scale, momentum)`` here for PyTorch-SSO's momentum and gradient EMA.

    ``native`` is the kind of gradient torchsso2's momentum accumulates in the target optimizer:
    ``'preconditioned'`` (SecondOrderOptimizer) or ``'raw'`` (VIOptimizer). The other kind is
    the same while the curvature is constant and is applied with a logged warning. A gradient
    EMA ``buf ← (1−d)·buf + d·g`` is the momentum ``1 − d`` with the learning rate times ``d``:
    the lr scale ``d``, by which the compat classes multiply their groups' lr (PyTorch-SSO's, as
    the user sets and schedules it) inside each update."""
    momentum = check_number("momentum", momentum)
    grad_ema_decay = check_number("grad_ema_decay", grad_ema_decay)
    if momentum < 0:
        raise ValueError(f"momentum={momentum!r} must be >= 0")
    if not 0.0 <= grad_ema_decay <= 1.0:
        raise ValueError(f"grad_ema_decay={grad_ema_decay!r} must be in [0, 1]")
    uses_ema = grad_ema_decay != 1.0
    if momentum > 0 and uses_ema:
        raise NotImplementedError("momentum > 0 together with grad_ema_decay != 1 (two gradient buffers) has no "
                                  "equivalent in torchsso2; keep one of them")
    for name, value in (("momentum_type", momentum_type), ("grad_ema_type", grad_ema_type)):
        if value not in ("raw", "preconditioned"):  # checked even where unused, as torch.optim checks arguments
            raise ValueError(f"{name}={value!r}; expected 'raw' or 'preconditioned'")
    kind = momentum_type if momentum > 0 else grad_ema_type
    if (momentum > 0 or uses_ema) and kind != native:
        logger.warning("PyTorch-SSO's %s momentum/gradient EMA is applied to the %s gradient here (the same "
                       "while the curvature does not change)", kind, native)
    if uses_ema:
        if grad_ema_decay == 0:
            raise ValueError("grad_ema_decay=0 never uses a gradient")
        return grad_ema_decay, 1.0 - grad_ema_decay
    return 1.0, momentum


def decay_placement(momentum: float, momentum_type: str, grad_ema_decay: float,
                    grad_ema_type: str) -> Tuple[bool, float]:
    """Where PyTorch-SSO's decoupled ``weight_decay`` goes: ``(into the buffer, lr factor)``, the factor
    applied to the groups' lr (PyTorch-SSO's). It adds ``wd·θ`` to the preconditioned gradient, so a
    buffer (momentum, else the gradient EMA) of preconditioned gradients takes it in, at the native lr
    (the groups' lr times ``d`` after a gradient EMA, :func:`momentum_settings`); after a buffer of raw
    gradients (or none) it is ``θ ← θ − lr·wd·θ`` at PyTorch-SSO's lr (factor 1)."""
    kind = momentum_type if momentum > 0 else (grad_ema_type if grad_ema_decay != 1.0 else None)
    in_buffer = kind == "preconditioned"
    return in_buffer, grad_ema_decay if in_buffer else 1.0


#: native keywords the compat classes set from PyTorch-SSO's arguments, and where each is given there
_SET_FROM = {"damping": "curv_kwargs={'damping': ...}", "ema_decay": "curv_kwargs={'ema_decay': ...}",
             "curvature": "curv_type ('Cov', 'Fisher', 'Hessian')", "approx": "curv_shapes ({'Linear': 'Kron', ...})",
             "mc_samples": "fisher_args={'approx_type': 'mc', 'num_mc': ...}",
             "kfac_method": "nothing (PyTorch-SSO inverts the damped factors; fixed here)"}


def check_native_keywords(native: Mapping[str, Any], face: str, sets: Tuple[str, ...]) -> None:
    """TypeError for a native keyword in ``native`` that the compat ``face`` sets itself (``sets``) from
    PyTorch-SSO's arguments, naming where PyTorch-SSO takes it (rather than Python's "got multiple values
    for keyword argument", which blames a keyword given once)."""
    clash = [k for k in native if k in sets]
    if clash:
        where = "; ".join(f"{k}= comes from {_SET_FROM[k]}" for k in clash)
        raise TypeError(f"compat {face}: {where} in PyTorch-SSO's signature; give it there, or build the native "
                        f"torchsso2.{face} to pass {', '.join(clash)} directly")


def branch_vi_keys(args: Dict[str, Any], prior_variance_default: Optional[float] = None) -> Dict[str, Any]:
    """``args`` with the VI keywords of PyTorch-SSO's ``continual-learning`` branch in ``master``'s terms:
    ``prior_precision`` p as ``prior_variance = 1/p``, ``init_prec_ema`` as ``init_precision``, ``prior_mean``
    0 dropped (else NotImplementedError). ``prior_variance_default``: a ``prior_variance`` equal to it is
    taken as not given (the compat constructor's default); another value with ``prior_precision`` is a
    ValueError."""
    args = dict(args)
    if "prior_precision" in args:
        precision = args.pop("prior_precision")
        given = args.get("prior_variance", prior_variance_default)
        if "prior_variance" in args and given not in (prior_variance_default, None):
            raise ValueError(f"both prior_precision={precision!r} and prior_variance={given!r} are given; give one "
                             "(prior_variance = 1/prior_precision)")
        if not isinstance(precision, (int, float)) or isinstance(precision, bool) or precision <= 0:
            raise ValueError(f"prior_precision={precision!r} must be a number > 0")
        args["prior_variance"] = 1.0 / precision
    if "init_prec_ema" in args:
        if args.get("init_precision") is not None:
            raise ValueError("both init_prec_ema and init_precision are given; give one (the same setting)")
        args["init_precision"] = args.pop("init_prec_ema")
    prior_mean = args.pop("prior_mean", 0)
    if prior_mean != 0:
        raise NotImplementedError(f"prior_mean={prior_mean!r}: a prior centred away from 0 has no equivalent in "
                                  "torchsso2 (its prior is N(0, prior_variance·I))")
    if "mc_group_id" in args:
        raise TypeError("mc_group_id= is DistributedVIOptimizer's (a rank's group of Monte-Carlo samples): the "
                        "compat classes run in one process; the native torchsso2.VIOptimizer spreads the samples "
                        "over ranks itself (docs/scaling.md)")
    return args


def reject_unsupported(**flags: Any) -> None:
    """NotImplementedError for PyTorch-SSO options that change the update and have no equivalent here."""
    messages = {
        "lars": "lars=True (LARS rescaling of each update) has no equivalent in torchsso2",
        "normalizing_weights": "normalizing_weights=True (rescaling weights after each step) has no equivalent "
                               "in torchsso2",
        "bias_correction": "bias_correction=True (Adam-style bias correction of the EMAs) has no equivalent in "
                           "torchsso2",
        "non_reg_for_bn": "non_reg_for_bn=True: pass native param groups with weight_decay=0 for BatchNorm "
                          "parameters instead (torchsso2.SecondOrderOptimizer(params=...))",
        "warmup_kl_weighting_steps": "warmup_kl_weighting_steps (a KL-weighting warm-up) has no equivalent in "
                                     "torchsso2; change opt.kl_weighting yourself between steps",
    }
    for name, value in flags.items():
        if value:
            raise NotImplementedError(messages[name])


def check_acc_steps(acc_steps: int) -> None:
    if acc_steps != 1:
        raise NotImplementedError(
            f"acc_steps={acc_steps!r}: accumulate inside the closure instead: run the {acc_steps} micro-batches' "
            f"forward and backward passes in one closure call, each mean loss multiplied by 1/{acc_steps} (n_i/N "
            "for unequal micro-batches; the gradients and curvature are sums over the backward passes), and pass "
            "the concatenated labels to step(closure, targets=y) for curv_type='Cov' (docs/guide.md, gradient "
            "accumulation)")
