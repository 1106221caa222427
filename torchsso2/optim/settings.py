"""The settings both native optimizers share, as one validated object.

:class:`SecondOrderOptimizer` and :class:`VIOptimizer` keep their public keyword arguments; each
collects the shared ones with :meth:`CurvatureSettings.from_arguments` (by name, from its own
arguments) and hands the one object to :class:`~torchsso2.optim.base.CurvatureOptimizer`, instead of
forwarding ~20 keywords by hand. The checks that need nothing but the values run once, here.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Mapping, Optional

import torch

from curvature.linalg import get_backend
from curvature.options import Kind, KFACApprox, check_mc_samples, parse

from .misuse import check_option
from .validation import MAX_STEPS, check_choice, check_int, check_number, dtype_named


@dataclass
class CurvatureSettings:
    """What the curvature engine, the running estimate and the distribution layer of a native
    optimizer are built from (meanings: the optimizers' docstrings)."""

    curvature: Any
    approx: Any
    loss: str
    mc_samples: int
    skip_modules: Any
    ema_decay: float
    curv_update_interval: int
    inv_update_interval: int
    on_nonfinite: str
    linalg: Optional[str]
    communicator: Any
    seed: Optional[int]
    decomposition_dtype: Optional[torch.dtype]
    grad_scaler: Any
    grad_worker_fraction: Any
    assignment_strategy: Any
    output_selector: Any
    max_consecutive_skips: Optional[int]
    kfac_approx: Any = "expand"
    #: cover modules no layer family knows by diagonal blocks of their own parameters (VIOptimizer's
    #: curvature="reparam": its estimate needs only the gradients; curvature.selection.select_layouts)
    any_module: bool = False

    def __post_init__(self) -> None:
        check_mc_samples(self.mc_samples, check_option(Kind, self.curvature, "curvature").value, "curvature")
        self.kfac_approx = parse(KFACApprox, self.kfac_approx, "kfac_approx").value
        self.ema_decay = check_number("ema_decay", self.ema_decay, low=0.0, high=1.0, high_open=True)
        self.curv_update_interval = check_int("curv_update_interval", self.curv_update_interval, high=MAX_STEPS)
        self.inv_update_interval = check_int("inv_update_interval", self.inv_update_interval, high=MAX_STEPS)
        self.on_nonfinite = check_choice("on_nonfinite", self.on_nonfinite, ("skip", "raise"))
        # validates the name (and cupy's availability) now, not at the first decomposition; None (the environment
        # variable, else "torch") is resolved once: every decomposition of the run takes the same backend
        backend = get_backend(self.linalg)
        if self.linalg is None or isinstance(self.linalg, str):  # resolved, and one spelling (" NumPy " → "numpy")
            self.linalg = backend.name
        scaler = self.grad_scaler
        if scaler is not None and not all(hasattr(scaler, a) for a in ("unscale_", "get_scale")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.decomposition_dtype = dtype_named(self.decomposition_dtype)  # "float64" from a config file
        if self.decomposition_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"decomposition_dtype={self.decomposition_dtype!r}; "
                             "expected None, torch.float32 or torch.float64")

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any], **overrides: Any) -> "CurvatureSettings":
        """The fields taken by name from ``arguments`` (a face's ``locals()``), ``overrides`` first;
        a field with a default may be missing (KeyError for a missing field without one)."""
        return cls(**{f.name: overrides[f.name] if f.name in overrides else
                      (arguments[f.name] if f.default is MISSING else arguments.get(f.name, f.default))
                      for f in fields(cls)})


__all__ = ["CurvatureSettings"]
