"""Observation noise of :class:`VIOptimizer`'s Gaussian likelihood (``loss="mse"``).

The closure's loss is the unit-variance ``½·mean_n ‖y_n − f_n‖²``; with observation noise ``σ²``
the negative log-likelihood per example is ``½‖y − f‖²/σ² + const``, so its gradient and its
curvature (Fisher = GGN) are the unit ones times ``1/σ²``. :class:`VIOptimizer` therefore uses
``N/σ²`` wherever the unit-variance case uses ``N`` (posterior precision ``Λ = (N/σ²)·C + τδ``,
the mean's step ``lr·Λ⁻¹((N/σ²)·g + τδ·μ)``), and :meth:`VIOptimizer.predict` adds ``σ²`` to the
spread of the sampled outputs.

``σ²`` is either given (a float) or ``"learned"``: the bias-corrected running mean of the mean
squared residual ``mean((y − f(θ_s))²)`` at the step's weight samples (``θ_s ~ q``), with decay
:data:`NOISE_EMA_DECAY`. That average is the maximiser of the ELBO over ``σ²``
(``E_q[mean (y − f)²]``, variational EM), so no data beyond the training batches are needed.
With several processes :class:`VIOptimizer` folds in the mean over all ranks of each rank's mean
squared residual (one all-reduce per step), so every rank holds the same ``σ²`` and W ranks on
W equal shards learn the ``σ²`` of one process on the whole batch.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Dict, Optional, Union

import torch
from torch import Tensor

from curvature.options import did_you_mean, float_or_inf

from .validation import MAX_VI_SCALE

__all__ = ["ObservationNoise", "NOISE_EMA_DECAY", "MIN_NOISE_VARIANCE"]

#: decay of the running mean of the squared residuals (``noise_variance="learned"``): ~100 steps,
#: long enough to average over batches and weight samples, short enough to follow the fit as it
#: improves (the residuals of the first steps come from an untrained model)
NOISE_EMA_DECAY = 0.99

#: smallest learned ``σ²`` (float32's eps): a batch fitted exactly must not give ``1/σ² = inf``
MIN_NOISE_VARIANCE = float(torch.finfo(torch.float32).eps)


class ObservationNoise:
    """``σ²`` of the Gaussian likelihood: a given value, or learned from the training residuals.

    Args:
        value: a finite float > 0 (given ``σ²``), or ``"learned"``.
    """

    def __init__(self, value: Union[float, str]) -> None:
        if isinstance(value, str):
            if value.strip().lower() != "learned":
                raise ValueError(f"noise_variance must be a float > 0 or 'learned', got {value!r}"
                                 f"{did_you_mean(value, ['learned'])}")
            self.learned = True
            self._given = 1.0
        else:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"noise_variance must be a float > 0 or 'learned', got {type(value).__name__} {value!r}")
            as_float = float_or_inf(value)
            if not math.isfinite(as_float) or as_float <= 0:
                raise ValueError(f"noise_variance must be a finite float > 0 or 'learned', got {value!r}")
            if not 1.0 / MAX_VI_SCALE <= as_float <= MAX_VI_SCALE:  # σ² and 1/σ² are float32 scalars of the step
                raise ValueError(f"noise_variance={value!r} is out of range; expected a value in "
                                 f"[{1.0 / MAX_VI_SCALE:g}, {MAX_VI_SCALE:g}] (σ² and 1/σ² within float32) or 'learned'")
            self.learned = False
            self._given = as_float
        self.ema = 0.0  #: running mean of the squared residuals (not bias-corrected)
        self.count = 0  #: batches folded into ``ema``

    @property
    def variance(self) -> float:
        """Today's ``σ²``: the given value, or the bias-corrected running mean (1 before any batch)."""
        if not self.learned:
            return self._given
        if self.count == 0:
            return 1.0
        return max(self.ema / (1.0 - NOISE_EMA_DECAY ** self.count), MIN_NOISE_VARIANCE)

    @staticmethod
    def mean_squared_residual(output: Tensor, targets: Tensor) -> float:
        """``mean((targets − output)²)`` over the entries with a finite target (``output`` and ``targets`` of one
        shape, e.g. ``[B, K]``; NaN marks a missing label)."""
        if not isinstance(targets, Tensor):
            raise TypeError(f"noise_variance='learned' needs step(closure, targets=y) with a tensor y, got "
                            f"{type(targets).__name__}")
        if output is None:
            raise ValueError("noise_variance='learned' compares the model output with the targets, and the closure "
                             "returned the loss alone without running the optimizer's model (with gradients "
                             "enabled); return (loss, output) from the closure")
        if not isinstance(output, Tensor) or tuple(output.shape) != tuple(targets.shape):
            shape = tuple(output.shape) if isinstance(output, Tensor) else type(output).__name__
            raise ValueError(f"noise_variance='learned' compares the model output with targets of the same shape; "
                             f"got output {shape} (returned by the closure, or its first completed forward of the model "
                             f"if it returned the loss alone) and targets {tuple(targets.shape)}"
                             + ("; with gradient accumulation, return (loss, torch.cat(outs)) from the closure: all "
                                "micro-batches' outputs concatenated in the targets' order"
                                if isinstance(output, Tensor) and output.shape[1:] == targets.shape[1:] else ""))
        squared = (targets.detach().to(output.dtype) - output.detach()).pow(2)
        observed = torch.isfinite(targets)  # missing labels (NaN) a masked loss skips: left out of σ²
        if not bool(observed.all()):
            return float(squared[observed].mean()) if bool(observed.any()) else math.nan
        return float(squared.mean())

    def update(self, mean_squared_residual: float) -> None:
        """Fold one batch's mean squared residual (averaged over its weight samples, and over the
        ranks with several processes) into the running mean."""
        if not self.learned or not math.isfinite(mean_squared_residual):
            return
        self.ema = NOISE_EMA_DECAY * self.ema + (1.0 - NOISE_EMA_DECAY) * mean_squared_residual
        self.count += 1

    def state(self) -> Dict[str, Any]:
        return {"learned": self.learned, "ema": self.ema, "count": self.count}

    def load(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore :meth:`state` (a checkpoint without it leaves the running mean as it is)."""
        if not state or not self.learned or not state.get("learned"):
            return
        ema, count = state.get("ema"), state.get("count")
        if not isinstance(ema, (int, float)) or not math.isfinite(float(ema)) or float(ema) < 0 \
                or not isinstance(count, int) or count < 0:
            raise ValueError(f"checkpoint entry ['torchsso2']['extra']['noise'] must hold a finite ema >= 0 and an "
                             f"int count >= 0, got {state!r}; the optimizer is unchanged")
        self.ema, self.count = float(ema), count
