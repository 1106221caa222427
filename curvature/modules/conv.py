"""nn.Conv2d, nn.Conv1d and nn.Conv3d as a Linear layer applied to unfolded patches.

Normal form: ``a [N, T, C_in·kh·kw]`` (``T = H_out·W_out`` patches in ``F.unfold``'s order, channel-
major like ``weight.reshape(C_out, -1)``), ``g [K, N, T, C_out]``. K-FAC as for Linear
(``G ⊗ A`` over row-major ``vec([W.reshape(C_out, -1) | b])``), exact when ``T = 1``; with
stride 1 ``A`` is computed from offset correlations of the input instead of unfolded patches
(:mod:`.conv_factor`, same numbers).
Supports any stride, padding (numeric, ``"valid"``, or ``"same"`` where it is symmetric; zeros mode),
dilation and groups; a grouped convolution (``groups > 1``) has diagonal and full blocks only
(:mod:`.grouped_conv`).
Patches come from :func:`unfold_patches` (a strided view copied once), not ``F.unfold``.
An ``nn.Conv1d`` is the Conv2d of a ``1 × k`` kernel over its input seen as ``[N, C, 1, L]``
(:class:`Conv1dFamily`): the same patches, factors and per-example gradients, in the same order as
``weight.reshape(C_out, -1)`` of its ``[C_out, C_in, k]`` weight.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.utils import _pair

from . import conv_factor
from .conv_factor import numeric_padding
from .base import channels_last_grad, gram
from .grouped_conv import grouped_per_example, grouped_sum_sq
from .linear import WeightMatrixFamily


Size2 = Union[int, Tuple[int, int]]


def unfold_patches(x: Tensor, kernel_size: Size2, dilation: Size2 = 1, padding: Size2 = 0,
                   stride: Size2 = 1) -> Tensor:
    """``F.unfold(x, ...)``, the same numbers in the same order: ``x [N, C, H, W]`` →
    ``[N, C·kh·kw, T]`` (``T = H_out·W_out``; rows channel-major, then kernel row, column).

    Built as a strided view of the zero-padded input (``Tensor.unfold`` per spatial dim) and
    copied once. ``F.unfold``'s im2col loop is 2–7× slower on CPU for the small maps of
    curvature work (N=128, C=3, 16×16, 3×3: 1.49 → 0.22 ms on one thread; C=16, stride 2:
    2.40 → 1.38 ms); the copy also uses a second thread where im2col does not gain
    (docs/architecture.md). Where the positions are few and the features many (a late depthwise layer:
    the copy's runs are ``T`` floats long), ``F.unfold`` itself is faster (N=64, C=256, 2×2: 4.7 → 1.5 ms;
    C=144, 4×4: 3.5 → 2.4 ms) and is called (:data:`UNFOLD_MAX_POSITIONS`, :data:`UNFOLD_MIN_FEATURES`)."""
    v = _windows(x, kernel_size, dilation, padding, stride)  # [N, C, Ho, Wo, kh, kw]
    n, c, ho, wo, kh, kw = v.shape
    if ho * wo <= UNFOLD_MAX_POSITIONS and c * kh * kw >= UNFOLD_MIN_FEATURES:
        return F.unfold(x, kernel_size, dilation=dilation, padding=padding, stride=stride)
    return v.permute(0, 1, 4, 5, 2, 3).reshape(n, c * kh * kw, ho * wo)


#: :func:`unfold_patches` calls ``F.unfold`` for at most this many output positions ...
UNFOLD_MAX_POSITIONS = 16
#: ... and at least this many features (``C·kh·kw``; one thread: C=16, 4×4 3×3 ties, C=144 F.unfold is 1.5×
#: faster, C=8 the strided copy is 1.8× faster)
UNFOLD_MIN_FEATURES = 576


def _windows(x: Tensor, kernel_size: Size2, dilation: Size2, padding: Size2, stride: Size2) -> Tensor:
    """The patches of ``x [N, C, H, W]`` as a strided view ``[N, C, Ho, Wo, kh, kw]`` of the zero-padded input."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = _pair(kernel_size), _pair(dilation), _pair(padding), _pair(stride)
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph))
    # windows of the dilated kernel's span, then every d-th element of each window
    return x.unfold(2, dh * (kh - 1) + 1, sh).unfold(3, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]


def patch_rows(x: Tensor, kernel_size: Size2, dilation: Size2 = 1, padding: Size2 = 0, stride: Size2 = 1,
               ones_row: bool = False) -> Tensor:
    """The unfolded patches feature-major, ``[C·kh·kw (+1), T·N]`` (rows as :func:`unfold_patches`;
    columns position-major, then example: column ``t·N + n``; with ``ones_row`` a last row of ones,
    the bias's input), copied once from strided windows into the result. Its Gram matrix is
    the K-FAC input factor, whatever the column order.

    The windows are taken of the input moved to ``[C, H, W, N]`` (one copy of the small, padded
    input), so every run the copy moves is the N examples of one position, contiguous at both
    ends; windows of ``[N, C, H, W]`` move runs of ``W_out`` (digits CNN conv2 at batch 128,
    ``[73, 2048]`` from 4×4 maps: 0.30 → 0.08 ms). The input is copied into the interior of a zeroed
    ``[C, Hp, Wp, N]`` buffer, not padded first (``F.pad`` is a second copy: 28 µs of [128, 8, 4, 4])."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = _pair(kernel_size), _pair(dilation), _pair(padding), _pair(stride)
    n0, c0, h0, w0 = x.shape
    if ph or pw:
        xt = x.new_zeros(c0, h0 + 2 * ph, w0 + 2 * pw, n0)  # [C, Hp, Wp, N]
        xt[:, ph:ph + h0, pw:pw + w0].copy_(x.permute(1, 2, 3, 0))
    else:
        xt = x.permute(1, 2, 3, 0).contiguous()  # [C, H, W, N]
    v = xt.unfold(1, dh * (kh - 1) + 1, sh).unfold(2, dw * (kw - 1) + 1, sw)[..., ::dh, ::dw]  # [C, Ho, Wo, N, kh, kw]
    c, ho, wo, n = v.shape[:4]
    d = c * kh * kw
    out = x.new_empty(d + int(ones_row), ho * wo * n)
    out[:d].view(c, kh, kw, ho, wo, n).copy_(v.permute(0, 4, 5, 1, 2, 3))
    if ones_row:
        out[d].fill_(1.0)
    return out


#: the bias's row of ones is left out of the patch Gram (:func:`gram_with_ones_row`) for ``d`` patch
#: rows with ``d >= SPLIT_MIN_ROWS``, ``d % 8 == 0`` and at least ``SPLIT_MIN_COLUMNS`` columns: BLAS
#: multiplies 72 rows faster than 73 (digits CNN conv2, ``[72, 2048]``: 0.314 → 0.282 ms with the
#: assembly; ``[128, 2048]``: 0.79 → 0.73), but the assembly costs more than it saves for few
#: rows or columns (``[9, 8192]`` 0.059 → 0.059, ``[64, 128]`` 0.021 → 0.029)
SPLIT_MIN_ROWS = 64
SPLIT_MIN_COLUMNS = 1024


def split_bias_row(d: int, columns: int) -> bool:
    """Whether the Gram of ``d`` patch rows and a row of ones takes :func:`gram_with_ones_row`."""
    return d >= SPLIT_MIN_ROWS and d % 8 == 0 and columns >= SPLIT_MIN_COLUMNS


def patch_columns(x: Tensor, module: nn.Module) -> int:
    """``N · H_out · W_out``: the columns of :func:`patch_rows` of ``x [N, C, H, W]`` for ``module`` (a Conv2d or a
    :class:`ConvView`)."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = (_pair(module.kernel_size), _pair(module.dilation),
                                              numeric_padding(module), _pair(module.stride))
    ho = (x.shape[-2] + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (x.shape[-1] + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    return x.shape[0] * ho * wo


def gram_with_ones_row(m: Tensor, scale: float) -> Tensor:
    """``scale · [m; 1] [m; 1]ᵀ`` for ``m [d, M]`` without the row of ones: ``[d + 1, d + 1]``,
    assembled from ``m mᵀ``, the row sums ``m 1`` and ``M`` (equal to :func:`gram` of the stacked
    matrix up to the rounding of the sums' order)."""
    g = m @ m.t()
    s = m.sum(1, keepdim=True)  # [d, 1]
    top = torch.cat([g, s], 1)
    bottom = torch.cat([s.t(), s.new_full((1, 1), float(m.shape[1]))], 1)
    return torch.cat([top, bottom], 0).mul_(scale)


def refuse_grouped_kfac(module: nn.Module) -> None:
    """NotImplementedError for K-FAC factors of a grouped convolution (the selection gives it other shapes)."""
    if module.groups != 1:
        raise NotImplementedError(f"K-FAC factors of a convolution with groups={module.groups} are not defined")


class ConvFamily(WeightMatrixFamily):
    """What Conv1d/2d/3d share: the checks of their options, and a grouped layer's per-example gradients and
    diagonal sums (:mod:`.grouped_conv`; its rows of ``weight.reshape(C_out, -1)`` read only their group's
    features of the patch)."""

    def validate(self, module: nn.Module) -> None:
        numeric_padding(module)  # "valid", "same" with a symmetric padding, or numbers
        if module.padding_mode != "zeros":
            raise ValueError(f"{type(module).__name__} with padding_mode={module.padding_mode!r} is not supported "
                             "('zeros' only)")

    def kfac_undefined(self, module: nn.Module) -> Optional[str]:
        if module.groups != 1:
            return (f"K-FAC is not defined for a {type(module).__name__} with groups={module.groups} (each group "
                    "would need its own pair of factors)")
        return None

    def per_example_rows(self, module: nn.Module, a: Tensor, g: Tensor) -> Tensor:
        if module.groups == 1:
            return super().per_example_rows(module, a, g)
        return grouped_per_example(a, g, module.groups)

    def diag_sum(self, module: nn.Module, a: Tensor, g: Tensor, names: Sequence[str]) -> Optional[Tensor]:
        if module.groups == 1:
            return super().diag_sum(module, a, g, names)
        parts = {}
        if "weight" in names:
            parts["weight"] = grouped_sum_sq(a, g, module.groups).reshape(-1)
        if "bias" in names:
            parts["bias"] = g.sum(dim=2).pow(2).sum(dim=(0, 1))
        return torch.cat([parts[n] for n in names])

    def kfac_factors(self, module: nn.Module, a: Tensor, g: Tensor, names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        refuse_grouped_kfac(module)
        return super().kfac_factors(module, a, g, names)


class Conv2dFamily(ConvFamily):
    """``nn.Conv2d`` (zero padding): the weight ``[C_out, C_in/groups·kh·kw]`` applied to the ``T``
    unfolded patches of each example (``a_t``: ``[C_in·kh·kw]``, with a 1 for the bias; a grouped layer's rows
    to their group's part of it)."""

    module_types = (nn.Conv2d,)

    def batched_output_dim(self, module: nn.Module) -> Optional[int]:
        return 4  # [N, C, H, W]

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = inputs[0].detach()
        if x.dim() == 3:
            x = x.unsqueeze(0)
        patches = unfold_patches(x, module.kernel_size, dilation=module.dilation,
                                 padding=numeric_padding(module), stride=module.stride)  # [N, C·kh·kw, T]
        return patches.transpose(1, 2)

    def kfac_factors_from_inputs(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Optional[Tensor],
                                 g: Tensor, names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        """With stride 1 the input factor comes from offset correlations of the input
        (:mod:`curvature.modules.conv_factor`: ~6× fewer FLOPs for 3×3, no unfolded patches)."""
        refuse_grouped_kfac(module)
        x = inputs[0].detach()
        if x.dim() == 3:
            x = x.unsqueeze(0)
        if "weight" not in names:
            return super().kfac_factors_from_inputs(module, inputs, output, g, names)
        if not conv_factor.offset_factor_pays(module, (x.shape[-2], x.shape[-1])):  # from the patches, copied once
            bias = "bias" in names
            d = module.in_channels * module.kernel_size[0] * module.kernel_size[1]
            split = bias and split_bias_row(d, patch_columns(x, module))
            m = patch_rows(x.to(g.dtype), module.kernel_size, dilation=module.dilation,
                           padding=numeric_padding(module), stride=module.stride, ones_row=bias and not split)
            a = gram_with_ones_row(m, 1.0 / m.shape[1]) if split else gram(m, 1.0 / m.shape[1])
            return self.kfac_output_factor(module, None, g, names), a
        big_a = conv_factor.conv_input_factor(x.to(g.dtype), module.kernel_size, module.dilation, numeric_padding(module),
                                              bias="bias" in names)
        return self.kfac_output_factor(module, None, g, names), big_a.div_(x.shape[0] * g.shape[2])

    def normal_output_grad(self, module: nn.Module, g: Tensor) -> Tensor:
        return channels_last_grad(g)


class ConvView(NamedTuple):
    """A convolution's hyperparameters (numeric padding), read by :class:`Conv2dFamily` or :class:`Conv3dFamily`
    in place of a module: an ``nn.Conv1d`` as the Conv2d of a ``1 × k`` kernel (:func:`as_conv2d`), a transposed
    convolution as the stride-1 convolution it equals (:mod:`.conv_transpose`)."""

    kernel_size: Tuple[int, int]
    stride: Tuple[int, int]
    dilation: Tuple[int, int]
    padding: Tuple[int, int]
    in_channels: int
    groups: int
    padding_mode: str


def as_conv2d(module: nn.Conv1d) -> ConvView:
    """``module`` as the Conv2d over its input seen as ``[N, C, 1, L]``."""
    return ConvView((1, module.kernel_size[0]), (1, module.stride[0]), (1, module.dilation[0]),
                      (0, numeric_padding(module)[0]), module.in_channels, module.groups, module.padding_mode)


def as_conv2d_inputs(inputs: Tuple[Tensor, ...]) -> Tuple[Tensor, ...]:
    """A Conv1d's recorded inputs ``([N, C, L], ...)`` with the input as ``[N, C, 1, L]``: a view."""
    return (inputs[0].unsqueeze(-2),) + tuple(inputs[1:])


#: the Conv2d math a Conv1d is run through
_CONV2D = Conv2dFamily()


class Conv1dFamily(ConvFamily):
    """``nn.Conv1d`` (zero padding) as the Conv2d of a ``1 × k`` kernel over ``[N, C, 1, L]``: the
    weight ``[C_out, C_in·k]`` applied to the ``T = L_out`` unfolded patches of each example. The patches and
    the input factor are Conv2d's (:data:`_CONV2D`, called with the view :func:`as_conv2d` and the input as
    ``[N, C, 1, L]``: its own calls then see the view only); per-example gradients, diagonal sums and the
    output factor are :class:`ConvFamily`'s, whose shapes are the same."""

    module_types = (nn.Conv1d,)

    def batched_output_dim(self, module: nn.Module) -> Optional[int]:
        return 3  # [N, C, L]

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        return _CONV2D.normal_input(as_conv2d(module), as_conv2d_inputs(inputs), output)

    def normal_output_grad(self, module: nn.Module, g: Tensor) -> Tensor:
        return channels_last_grad(g)  # [K, N, C, L] -> [K, N, L, C]

    def kfac_factors_from_inputs(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Optional[Tensor],
                                 g: Tensor, names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        return _CONV2D.kfac_factors_from_inputs(as_conv2d(module), as_conv2d_inputs(inputs), output, g, names)


def unfold_patches_3d(x: Tensor, module: nn.Module) -> Tensor:
    """The patches of ``x [N, C, D, H, W]`` for the Conv3d ``module``: ``[N, T, C·kd·kh·kw]`` (``T = D_out·H_out·
    W_out``; features channel-major, then kernel depth, row, column: the order of ``weight.reshape(C_out, -1)``),
    a view of :func:`patch_rows_3d` (feature-major, as Conv2d's normal form)."""
    rows = patch_rows_3d(x, module)  # [d, T·N], column t·N + n
    return rows.t().reshape(-1, x.shape[0], rows.shape[0]).transpose(0, 1)


def patch_rows_3d(x: Tensor, module: nn.Module) -> Tensor:
    """The patches of ``x [N, C, D, H, W]`` for the Conv3d ``module``, feature-major: ``[C·kd·kh·kw, T·N]``
    (rows channel-major, then kernel depth, row, column; column ``t·N + n``), from a strided view of the
    zero-padded input moved to ``[C, D, H, W, N]`` first, so that the one copy moves the N examples of a
    position as contiguous runs (as :func:`patch_rows` does in 2-D)."""
    kernel, dilation, stride = module.kernel_size, module.dilation, module.stride
    pd, ph, pw = numeric_padding(module)
    xt = x.permute(1, 2, 3, 4, 0)  # [C, D, H, W, N]
    if pd or ph or pw:
        xt = F.pad(xt, (0, 0, pw, pw, ph, ph, pd, pd))
    for dim, (k, d, st) in enumerate(zip(kernel, dilation, stride), start=1):
        xt = xt.unfold(dim, d * (k - 1) + 1, st)
    v = xt[..., ::dilation[0], ::dilation[1], ::dilation[2]]  # [C, Do, Ho, Wo, N, kd, kh, kw]
    c = v.shape[0]
    return v.permute(0, 5, 6, 7, 1, 2, 3, 4).reshape(c * kernel[0] * kernel[1] * kernel[2], -1)


class Conv3dFamily(ConvFamily):
    """``nn.Conv3d`` (zero padding): the weight ``[C_out, C_in/groups·kd·kh·kw]`` applied to the ``T`` unfolded
    patches of each example (:func:`unfold_patches_3d`; no offset-correlation route: its input factor is the Gram
    matrix of the patches, ``[C_in·k³, N·T]`` in memory, :func:`patch_rows_3d`)."""

    module_types = (nn.Conv3d,)

    def batched_output_dim(self, module: nn.Module) -> Optional[int]:
        return 5  # [N, C, D, H, W]

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        return unfold_patches_3d(inputs[0].detach(), module)

    def normal_output_grad(self, module: nn.Module, g: Tensor) -> Tensor:
        return channels_last_grad(g)  # [K, N, C, D, H, W] -> [K, N, T, C]

    def kfac_factors_from_inputs(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Optional[Tensor],
                                 g: Tensor, names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        """The input factor from feature-major patch rows (:func:`patch_rows_3d`) and the bias's row of ones
        assembled, not concatenated (:func:`gram_with_ones_row`): N=8, C=8, 16³, 3×3×3 at one thread, the
        normal form's permuted copy and concatenation had taken 119 ms of a 226 ms step; the step is 75 ms.
        The same numbers (tests/test_conv3d.py, the brute-force reference)."""
        refuse_grouped_kfac(module)
        if "weight" not in names:
            return super().kfac_factors_from_inputs(module, inputs, output, g, names)
        m = patch_rows_3d(inputs[0].detach().to(g.dtype), module)
        scale = 1.0 / m.shape[1]
        a = gram_with_ones_row(m, scale) if "bias" in names else gram(m, scale)
        return self.kfac_output_factor(module, None, g, names), a
