"""VIOptimizer's defaults, each with the measurement behind it (docs/defaults.md has the tables)."""
from __future__ import annotations

#: Default start of the curvature EMA, ``C₀ = curvature_init·I`` (IVON's ``hess_init``; per example,
#: the units of the Fisher of the mean loss). Λ₀ = N·1 + τδ: the first weight samples have std
#: ≈ 1/√N (0.024 on the digits) and the first mean steps are ≈ ``lr·m``, SGD with momentum at
#: ``lr``; the slow EMA (``ema_decay`` 0.99999) keeps C near the start on runs of ≲ 10⁵ steps. Starting
#: from the first batch's estimate instead (``curvature_init=None``) gave
#: steps ``N/(τδ)`` times the gradient along its near-zero directions: non-finite losses after
#: ~45 steps at lr 1e-2 on the digits MLP. 0.1 diverged at lr 0.1 (loss 3.9e4); 1 trains for
#: lr from 1e-3 to 0.3 (tests/test_defaults.py).
DEFAULT_CURVATURE_INIT = 1.0

#: Default decay of the curvature EMA (IVON's ``beta2``): the start ``curvature_init·I`` keeps the
#: weight ``ema_decay^t`` after t steps (0.97 after 3400 steps, 0.37 after 10⁵). The data's
#: per-example curvature is far below the start (digits MLP: ~1e-3 against 1), and the posterior
#: it implies (Λ ≈ N·1e-3 + δ per weight: samples of std ~0.7 around weights of rms 0.3) predicts
#: worse than the start's narrow one. With 0.999 the start had faded to 0.034 after 200 epochs
#: (3400 steps) of the digits MLP and VI fell behind (validation NLL 0.59–0.85 for lr ≥ 1e-2,
#: test NLL 0.165 at the best lr against IVON's 0.145 and Adam's 0.153, ECE 3.5% against 1.7%);
#: with 0.99999 the best validation NLL (seed 0, lr 0.1) is 0.105 at 40 epochs and 0.102 at 200
#: (benchmarks/vi.py, docs/defaults.md). On runs much longer than 10⁵ steps the data's
#: curvature takes over; pass a smaller ``ema_decay`` to let it shape the posterior sooner.
DEFAULT_VI_EMA_DECAY = 0.99999

#: Default learning rate of the mean: the middle of the 100× range (1e-3 … 1e-1) in which the
#: defaults train the digits MLP without a skipped step; with ``curvature_init`` = 1 the first
#: steps are SGD's at this lr (with momentum 0.9).
DEFAULT_VI_LR = 1e-2

#: Default KL clip of the mean's step (kfac_pytorch's ``kl_clip`` idea applied to VI): the step
#: ``lr·u``, ``u = N·(N·C + τδ + λ)⁻¹m``, is scaled by ``ν = min(1, √(kl_clip / (lr²·uᵀm)))``, a bound on
#: the step's size under the per-example precision ``Λ/N``. While ``C`` is near its start (``u ≈ m``) it
#: binds once ``lr·‖m‖ > √kl_clip``: inactive for lr <= 0.1 on the digits MLP, active at lr 0.1 on wider
#: models (784-1024-1024-10: ν ≈ 0.6), where larger lrs then take the same step; as the slow EMA moves ``C`` to the data's (smaller)
#: curvature the steps grow, and without it lr 0.1 drifted up late (40 epochs: batch loss back
#: to 4.9, final 0.165 instead of 0.004); with it lr 0.3 and 1.0 train too. ``None``: off.
DEFAULT_VI_KL_CLIP = 0.1

#: Default of ``momentum_debias`` (IVON's and Adam's momentum bias correction, the lr of step t times
#: ``1/(1 − momentum^t)``): off. The buffer ``m_t = Σ_k momentum^k g_{t−k}`` starts short, so without
#: it the first ~20 steps are up to 10× shorter than the later ones (at momentum 0.9), a built-in
#: warm-up. It is the one difference between VI diag's step and IVON's that lowers the digits CNN's
#: validation NLL, by little, and elsewhere it can raise it (paired over seeds, same weight
#: noise): digits CNN −0.0012 ± 0.0007 (80 seeds, lr 1e-2), digits MLP +0.0025 ± 0.0009 (lr 0.1) and
#: −0.005 ± 0.009 (lr 0.32), diabetes +0.0006 ± 0.0002 (lr 3.2e-3); docs/defaults.md.
DEFAULT_VI_MOMENTUM_DEBIAS = False
