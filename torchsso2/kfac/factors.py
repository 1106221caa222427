"""kfac_pytorch's Kronecker factors, computed with the curvature engine's per-layer math.

The engine's families (:mod:`curvature.modules`) bring every layer to the normal form
``a [N, T, d_in]``, ``g [K, N, T, d_out]`` and give (:meth:`~curvature.modules.base.LayerFamily.kfac_factors`)

* ``A_eng = (1/(N·T)) Σ_{n,t} ã_nt ã_ntᵀ``   (``ã = [a, 1]`` when the layer has a bias),
* ``G_eng = (1/N) Σ_{n,t} g_nt g_ntᵀ``        (here ``K = 1``: ``g`` is what the user's
  ``backward()`` delivers, the gradient of *their* loss w.r.t. the layer output).

kfac_pytorch scales them differently, and tuned hyper-parameters (``damping`` above all)
only carry over when the factors match. Its convention, reproduced here exactly:

================  =============================  ==============================
layer             ``A``                          ``G``
================  =============================  ==============================
``nn.Linear``     ``A_eng``  = Σ ããᵀ / (N·T)      ``G_eng / T`` = Σ ggᵀ / (N·T)
``nn.Conv2d``     ``A_eng / T²`` = Σ ããᵀ / (N·T³)  ``G_eng / T³`` = Σ ggᵀ / (N·T³)
================  =============================  ==============================

(``T = 1`` for a plain ``[N, d]`` Linear input, ``T = H_out·W_out`` for Conv2d.) For a mean
loss ``L = (1/N) Σ ℓ_n`` the output gradient is ``g_n = u_n / N`` with ``u_n = ∂ℓ_n/∂out``,
so Linear's ``G = Σ u_n u_nᵀ / N³``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from curvature.modules.base import LayerFamily

__all__ = ["kfac_pytorch_factors", "kfac_pytorch_scales"]


def kfac_pytorch_scales(module: nn.Module, positions: int) -> Tuple[float, float]:
    """``(s_A, s_G)`` with ``A = s_A·A_eng``, ``G = s_G·G_eng`` (see the module docstring).

    Args:
        module: the layer (``nn.Conv2d`` or ``nn.Linear``).
        positions: ``T``, the number of weight-sharing positions of the normal form.
    """
    t = float(positions)
    if isinstance(module, nn.Conv2d):
        return 1.0 / t ** 2, 1.0 / t ** 3
    return 1.0, 1.0 / t


def kfac_pytorch_factors(family: LayerFamily, module: nn.Module, inputs: Tuple[Tensor, ...],
                         grad_output: Tensor, names: Sequence[str],
                         factor_dtype: Optional[torch.dtype] = None,
                         grad_scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """``(A, G)`` of one forward/backward pair of ``module``, kfac_pytorch-scaled.

    Args:
        family: the engine family of ``module``.
        inputs: the module's forward inputs (``inputs[0]`` is the layer input).
        grad_output: ``∂loss/∂output``, shape of the module output ``[N, ...]``.
        names: covered parameter names (``("weight",)`` or ``("weight", "bias")``).
        factor_dtype: dtype of the factor computation (``None``: the tensors' own dtype, but at
            least float32 — under ``torch.autocast`` with bfloat16/float16 activations the
            factors are still accumulated in float32; kfac_pytorch would keep them in half).
        grad_scale: AMP loss scale; ``grad_output`` is divided by it first.

    Returns:
        ``A [d_in(+1), d_in(+1)]`` and ``G [d_out, d_out]``, in ``factor_dtype`` (or the
        gradient's dtype).
    """
    x = inputs[0]
    if factor_dtype is None and grad_output.dtype in (torch.float16, torch.bfloat16):
        factor_dtype = torch.float32
    if factor_dtype is not None:
        x = x.to(factor_dtype) if x.is_floating_point() else x
        grad_output = grad_output.to(factor_dtype)
    if grad_scale is not None:
        grad_output = grad_output / grad_scale
    # the families ignore ``output`` for Linear/Conv2d (they only read the input); a stride-1
    # Conv2d's A comes from offset correlations (curvature/modules/conv_factor.py), not patches
    if isinstance(module, nn.Conv2d) and x.dim() == 3:  # an unbatched [C, H, W] call: one example
        x, grad_output = x.unsqueeze(0), grad_output.unsqueeze(0)
    g = family.normal_output_grad(module, grad_output.unsqueeze(0))
    left, right = family.kfac_factors_from_inputs(module, (x,) + tuple(inputs[1:]), None, g, names)
    by_name = dict(zip(family.kfac_names(), (left, right)))
    s_a, s_g = kfac_pytorch_scales(module, g.shape[2])
    big_a, big_g = by_name["A"], by_name["G"]
    if s_a != 1.0:
        big_a = big_a * s_a
    if s_g != 1.0:
        big_g = big_g * s_g
    return big_a, big_g
