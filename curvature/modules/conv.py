"""nn.Conv2d as a Linear layer applied to unfolded patches.

Normal form: ``a [N, T, C_in·kh·kw]`` (``T = H_out·W_out`` patches from ``F.unfold``, channel-
major like ``weight.reshape(C_out, -1)``), ``g [K, N, T, C_out]``. K-FAC as for Linear
(``G ⊗ A`` over row-major ``vec([W.reshape(C_out, -1) | b])``), exact when ``T = 1``; with
stride 1 ``A`` is computed from offset correlations of the input instead of unfolded patches
(:mod:`.conv_factor`, same numbers).
Supports any stride, padding (numeric, zeros mode), dilation; ``groups=1`` only.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch.nn.functional as F
from torch import Tensor, nn

from . import conv_factor
from .linear import WeightMatrixFamily


class Conv2dFamily(WeightMatrixFamily):
    module_types = (nn.Conv2d,)

    def validate(self, module: nn.Module) -> None:
        if module.groups != 1:
            raise ValueError(f"Conv2d with groups={module.groups} is not supported (groups=1 only)")
        if isinstance(module.padding, str):
            raise ValueError(f"Conv2d with padding={module.padding!r} is not supported; use numeric padding")
        if module.padding_mode != "zeros":
            raise ValueError(f"Conv2d with padding_mode={module.padding_mode!r} is not supported ('zeros' only)")

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = inputs[0].detach()
        if x.dim() == 3:
            x = x.unsqueeze(0)
        patches = F.unfold(x, module.kernel_size, dilation=module.dilation,
                           padding=module.padding, stride=module.stride)  # [N, C·kh·kw, T]
        return patches.transpose(1, 2)

    def kfac_factors_from_inputs(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Optional[Tensor],
                                 g: Tensor, names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        """With stride 1 the input factor comes from offset correlations of the input
        (:mod:`curvature.modules.conv_factor`: ~6× fewer FLOPs for 3×3, no unfolded patches)."""
        x = inputs[0].detach()
        if x.dim() == 3:
            x = x.unsqueeze(0)
        if "weight" not in names or not conv_factor.offset_factor_pays(module, (x.shape[-2], x.shape[-1])):
            return super().kfac_factors_from_inputs(module, inputs, output, g, names)
        big_a = conv_factor.conv_input_factor(x.to(g.dtype), module.kernel_size, module.dilation, module.padding,
                                              bias="bias" in names)
        return self.kfac_output_factor(module, None, g, names), big_a.div_(x.shape[0] * g.shape[2])

    def normal_output_grad(self, module: nn.Module, g: Tensor) -> Tensor:
        k, n, c = g.shape[0], g.shape[1], g.shape[2]
        return g.reshape(k, n, c, -1).transpose(2, 3)
