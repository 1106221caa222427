"""nn.ConvTranspose1d/2d/3d as the stride-1 convolution of the zero-inserted input.

A transposed convolution (per spatial dimension: stride ``s``, padding ``p``, dilation ``d``, kernel ``k``,
output padding ``o``) equals a convolution of stride 1, dilation ``d`` and no padding, with the kernel

    ``W'[o_c, i_c, κ] = W[i_c, o_c, k − 1 − κ]``

(the weight ``[C_in, C_out, *k]`` with its two channel dimensions swapped and its kernel flipped), applied to
``x̃``: the input with ``s − 1`` zeros inserted between neighbours, ``d(k − 1) − p`` zeros before and
``d(k − 1) − p + o`` after (a negative count crops). Output position ``t`` is ``W'`` times the patch of ``x̃``
at ``t``, so the layer is a weight matrix at ``T`` positions, as a convolution is, and Conv1d/2d/3d's patches
and input factor serve it (:func:`equivalent_conv`).

Normal form: ``a [N, T, C_in·∏k]`` (the patches of ``x̃``, features channel-major then kernel offsets, ``T``
the output positions), ``g [K, N, T, C_out]``. K-FAC's parameter matrix is ``M = [W'.reshape(C_out, -1) | b]``
(``G ⊗ A`` over its row-major ``vec``, as Linear's); the weight is not a column split of ``M``, so
:meth:`ConvTransposeFamily.to_matrix` / ``from_matrix`` permute (:func:`weight_to_rows`, :func:`rows_to_weight`).
The output size is read from the recorded output, so a call with ``output_size=`` is covered as well.
Groups 1 only. The patches of ``x̃`` hold ``s^dims`` times as many positions as the input (zeros in between):
their cost is that of the convolution the layer equals.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .base import channels_last_grad
from .conv import _CONV2D, Conv3dFamily, ConvView
from .linear import WeightMatrixFamily

_CONV3D = Conv3dFamily()


def _kernel_dims(module: nn.Module, lead: int) -> Tuple[int, ...]:
    """The kernel's dimensions in a weight-shaped tensor with ``lead`` leading dimensions."""
    return tuple(range(lead + 2, lead + 2 + len(module.kernel_size)))


def weight_to_rows(module: nn.Module, w: Tensor) -> Tensor:
    """Weights ``w [..., C_in, C_out, *k]`` as the rows of ``W'``: ``[..., C_out, C_in·∏k]`` (channels swapped,
    kernel flipped; a copy)."""
    lead = w.dim() - 2 - len(module.kernel_size)
    m = w.flip(_kernel_dims(module, lead)).transpose(lead, lead + 1)
    return m.reshape(w.shape[:lead] + (w.shape[lead + 1], -1))


def rows_to_weight(module: nn.Module, m: Tensor) -> Tensor:
    """Inverse of :func:`weight_to_rows`: ``m [..., C_out, C_in·∏k]`` → ``[..., C_in, C_out, *k]`` (a copy)."""
    lead = m.dim() - 2
    c_in, c_out = module.weight.shape[:2]
    w = m.reshape(m.shape[:lead] + (c_out, c_in) + tuple(module.kernel_size)).transpose(lead, lead + 1)
    return w.flip(_kernel_dims(module, lead))


def zero_inserted(x: Tensor, module: nn.Module, out_size: Sequence[int]) -> Tensor:
    """``x̃ [N, C_in, *S̃]`` of ``x [N, C_in, *S]`` for the transposed convolution ``module`` whose output has the
    spatial size ``out_size``: ``S̃ = out_size + d(k − 1)``; input element ``q`` sits at ``d(k − 1) − p + s·q``
    (those falling outside are cropped: they reach no output position). One zeroed buffer, one strided copy."""
    s, p, d, k = module.stride, module.padding, module.dilation, module.kernel_size
    size = [o + di * (ki - 1) for o, di, ki in zip(out_size, d, k)]
    out = x.new_zeros(tuple(x.shape[:2]) + tuple(size))
    dst: List[slice] = [slice(None), slice(None)]
    src: List[slice] = [slice(None), slice(None)]
    for n_in, full, si, pi, di, ki in zip(x.shape[2:], size, s, p, d, k):
        lead = di * (ki - 1) - pi
        first = -(lead // si) if lead < 0 else 0  # the first q with lead + s·q >= 0
        last = min(n_in - 1, (full - 1 - lead) // si)  # the last q with lead + s·q < full
        if last < first:  # no input element reaches an output position
            return out
        src.append(slice(first, last + 1))
        dst.append(slice(lead + si * first, lead + si * last + 1, si))
    out[tuple(dst)] = x[tuple(src)]
    return out


def equivalent_conv(module: nn.Module, x: Tensor, out_size: Sequence[int]
                    ) -> Tuple[WeightMatrixFamily, ConvView, Tensor]:
    """``(family, view, input)``: the convolution family, its hyperparameters and input that give ``module``'s
    patches: stride 1, ``module``'s dilation, no padding, over :func:`zero_inserted` ``x`` (a ConvTranspose1d
    as the Conv2d of a ``1 × k`` kernel over ``[N, C, 1, L̃]``, as a Conv1d is)."""
    xt = zero_inserted(x, module, out_size)
    dims = len(module.kernel_size)
    if dims == 1:
        view = ConvView((1, module.kernel_size[0]), (1, 1), (1, module.dilation[0]), (0, 0), module.in_channels, 1,
                        "zeros")
        return _CONV2D, view, xt.unsqueeze(-2)
    view = ConvView(tuple(module.kernel_size), (1,) * dims, tuple(module.dilation), (0,) * dims, module.in_channels,
                    1, "zeros")
    return (_CONV2D if dims == 2 else _CONV3D), view, xt


class ConvTransposeFamily(WeightMatrixFamily):
    """``nn.ConvTranspose1d/2d/3d`` (groups 1): the matrix ``W' [C_out, C_in·∏k]`` (:func:`weight_to_rows`)
    applied to the ``T`` patches of the zero-inserted input at the output positions (module docstring)."""

    module_types = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
    matrix_layout = "transposed_conv"

    def batched_output_dim(self, module: nn.Module) -> Optional[int]:
        return 2 + len(module.kernel_size)  # [N, C, *positions]

    def validate(self, module: nn.Module) -> None:
        if module.groups != 1:
            raise ValueError(f"{type(module).__name__} with groups={module.groups} is not supported (groups=1 only)")
        _CONV2D.validate(module)  # the padding mode (torch allows only zeros; a module changed after construction)

    def weight_matrix_shape(self, module: nn.Module) -> Tuple[int, int]:
        w = module.weight
        return int(w.shape[1]), int(w.shape[0]) * math.prod(w.shape[2:])

    def _conv(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor
              ) -> Tuple[WeightMatrixFamily, ConvView, Tuple[Tensor, ...]]:
        x = inputs[0].detach()
        fam, view, xt = equivalent_conv(module, x, tuple(output.shape[2:]))
        return fam, view, (xt,)

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        fam, view, xin = self._conv(module, inputs, output)
        return fam.normal_input(view, xin, output)

    def normal_output_grad(self, module: nn.Module, g: Tensor) -> Tensor:
        return channels_last_grad(g)  # [K, N, C_out, *positions] -> [K, N, T, C_out]

    def kfac_factors_from_inputs(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Optional[Tensor],
                                 g: Tensor, names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        if output is None:  # the output size (output_padding, output_size=) is read from the output
            raise ValueError(f"{type(module).__name__}'s K-FAC factors need the recorded output's shape")
        fam, view, xin = self._conv(module, inputs, output)
        return fam.kfac_factors_from_inputs(view, xin, output, g, names)

    def weight_from_rows(self, module: nn.Module, m: Tensor) -> Tensor:
        return rows_to_weight(module, m)

    def diag_sum(self, module: nn.Module, a: Tensor, g: Tensor, names: Sequence[str]) -> Optional[Tensor]:
        """:class:`WeightMatrixFamily`'s sums, the weight's part moved from ``W'``'s order to the weight's."""
        total = super().diag_sum(module, a, g, names)
        if total is None or "weight" not in names:
            return total
        start = 0 if names[0] == "weight" else module.weight.shape[1]  # ("bias", "weight"): the bias first
        n = module.weight.numel()
        rows, cols = self.weight_matrix_shape(module)
        part = total[start:start + n]
        part.copy_(rows_to_weight(module, part.view(rows, cols)).reshape(-1))
        return total

    def kfac_input_classes(self, module: nn.Module, names: Sequence[str]) -> Optional[Tensor]:
        """The stride residue of each patch feature's offset: a feature at kernel offset ``κ`` reads ``x̃`` at
        ``t + d·κ``, which holds input data only where that is ``≡ d(k − 1) − p (mod s)``, so two features are
        nonzero at one position only if ``d·κ ≡ d·κ' (mod s)`` (per dimension): ``A`` is zero between classes
        of ``d·κ mod s`` (a stride-2 4×4 kernel: 4 blocks of a quarter of the rows). The bias's constant input
        meets every class: no classes then; none for stride 1 either."""
        if "bias" in names or "weight" not in names or all(s == 1 for s in module.stride):
            return None
        grids = torch.meshgrid(*[torch.arange(k) for k in module.kernel_size], indexing="ij")
        label = torch.zeros_like(grids[0])
        for grid, d, s in zip(grids, module.dilation, module.stride):
            label = label * s + (d * grid) % s
        if int(label.max()) == int(label.min()):
            return None
        return label.reshape(-1).repeat(module.in_channels)  # channel-major features: the pattern per channel

    def matrix_columns(self, module: nn.Module, names: Sequence[str]) -> Optional[List[Tuple[int, int]]]:
        return None  # M permutes the weight: to_matrix / from_matrix

    def to_matrix(self, module: nn.Module, tensors: Sequence[Tensor], names: Sequence[str]) -> Tensor:
        parts: Dict[str, Tensor] = dict(zip(names, tensors))
        cols = []
        if "weight" in parts:
            cols.append(weight_to_rows(module, parts["weight"]))
        if "bias" in parts:
            cols.append(parts["bias"].reshape(-1, 1))
        return cols[0] if len(cols) == 1 else torch.cat(cols, dim=1)

    def to_matrix_into(self, module: nn.Module, tensors: Sequence[Tensor], names: Sequence[str], out: Tensor) -> None:
        out.copy_(self.to_matrix(module, tensors, names))

    def from_matrix(self, module: nn.Module, matrix: Tensor, names: Sequence[str]) -> List[Tensor]:
        _, cols = self.weight_matrix_shape(module)
        out = {"weight": lambda: rows_to_weight(module, matrix[:, :cols]),
               "bias": lambda: matrix[:, cols if "weight" in names else 0]}
        return [out[n]() for n in names]
