"""VIOptimizer's default schedule: how often the curvature is estimated and decomposed, per ``approx``.

* :data:`DEFAULT_VI_INTERVALS` — ``(curv_update_interval, inv_update_interval)`` when they are not
  given: every step for ``approx="diag"`` (its default curvature, ``"reparam"``, comes from the
  step's own backward, so estimating costs nothing); for ``approx="kfac"`` (noisy K-FAC: the
  Monte-Carlo Fisher costs a second backward and the eigendecompositions of the factors cost more
  than the rest of the step) the curvature every 10 steps, each estimate decomposed at once (10/10).
  ``"full"`` and dicts keep 1/1 (not measured).
* :func:`vi_schedule` — the intervals and the curvature EMA's decay of one optimizer. The default
  decay is a decay **per step**: the EMA is updated once every ``curv_update_interval`` steps, so each
  update uses ``DEFAULT_VI_EMA_DECAY ** curv_update_interval`` and the start ``curvature_init·I`` keeps
  the weight ``DEFAULT_VI_EMA_DECAY^t`` after ``t`` steps whatever the interval (each estimate counts
  for the steps it stands for). An explicit ``ema_decay`` is the decay per update, as given.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .validation import MAX_STEPS, check_int

#: ``(curv_update_interval, inv_update_interval)`` by ``approx`` when not given (others: 1, 1).
#: noisy K-FAC at 10/10 against 1/1 (digits MLP 40 epochs and digits CNN 15 epochs, validation,
#: 10–20 paired seeds at the lr benchmarks/vi.py chose and its grid neighbours; docs/defaults.md):
#: the same accuracy, NLL and ECE within noise at about a third of the step time. Decomposing only
#: every 100 steps (10/100, kfac_pytorch's usual) was worse at the CNN's smaller lr (validation NLL
#: +0.0015 ± 0.0004, ECE +0.24 ± 0.07 pp) for little more speed (benchmarks/vi_kfac_intervals.py)
DEFAULT_VI_INTERVALS: Dict[str, Tuple[int, int]] = {"diag": (1, 1), "kfac": (10, 10)}


def vi_schedule(approx: Any, curv_update_interval: Optional[int], inv_update_interval: Optional[int],
                ema_decay: Optional[float], per_step_decay: float) -> Tuple[Any, Any, Any]:
    """``(curv_update_interval, inv_update_interval, ema_decay)`` with the defaults filled in.

    ``None`` means the default: the intervals of :data:`DEFAULT_VI_INTERVALS` for ``approx`` (a string;
    ``(1, 1)`` for others and for dicts), and ``per_step_decay ** curv_update_interval`` for the decay.
    Given values are returned as they are (checked later with the other settings); a curvature interval
    that is not an int >= 1 raises here, before the default decay is derived from it.
    """
    curv_default, inv_default = DEFAULT_VI_INTERVALS.get(approx, (1, 1)) if isinstance(approx, str) else (1, 1)
    curv = curv_default if curv_update_interval is None else curv_update_interval
    inv = inv_default if inv_update_interval is None else inv_update_interval
    if ema_decay is None:
        ema_decay = per_step_decay ** check_int("curv_update_interval", curv, high=MAX_STEPS)
    return curv, inv, ema_decay
