"""The contract every layer family implements, in one normal form.

Each supported layer is converted to

* ``a``: the layer's *input features* in normal form ``[N, T, d_in]`` (``T`` = weight-sharing
  positions: 1 for a plain Linear, ``H_out·W_out`` (``L_out``) unfolded patches for Conv2d (Conv1d), spatial
  positions for BatchNorm2d, leading dims for LayerNorm). For BatchNorm/LayerNorm it is the
  normalized input ``x̂``; for Embedding the token indices ``[N, T]``.
* ``g``: gradients w.r.t. the layer's output in normal form ``[K, N, T, d_out]`` (``K``
  backpropagated vectors per example, see :mod:`curvature.likelihoods`).

From ``(a, g)`` a family produces per-example gradients of its covered parameters and,
where meaningful, Kronecker factors. The blocks never know which layer they came from.

Parameter matrix (for K-FAC): every K-FAC-capable family lays its covered parameters out
as one matrix ``M`` of shape ``[rows, cols]`` and the K-FAC block is ``L ⊗ R`` over
row-major ``vec(M)``, ``L`` of size ``rows`` and ``R`` of size ``cols``.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn


class SkipDoesNotHelp(ValueError):
    """A layer configuration :meth:`LayerFamily.validate` refuses where leaving the module to the plain update
    (``skip_modules``) would not help either (``Embedding(sparse=True)``: the plain update needs dense
    gradients too); the refusal then suggests no skip."""


class GradientsDoNotHelp(ValueError):
    """A layer configuration :meth:`LayerFamily.validate` refuses that a diagonal block from the gradients
    alone (``VIOptimizer``'s default ``curvature="reparam"``, which covers modules the families refuse)
    cannot cover either: the forward rewrites the weights in place (``Embedding(max_norm=...)``: a weight
    sample would be renormalised, never the mean), or the gradient is not the loss's derivative
    (``scale_grad_by_freq``). ``skip_modules`` (the plain update) helps."""


class LayerFamily:
    """Base class: the math of one layer family. Subclasses are stateless."""

    #: the ``nn.Module`` types this family covers
    module_types: Tuple[type, ...] = ()
    #: whether a K-FAC factorization is defined for this family
    supports_kfac: bool = False
    #: whether K-FAC's left factor is stored as a diagonal ``[n]`` (Embedding's token counts ``A``)
    kfac_diagonal_left: bool = False
    #: whether :meth:`normal_input` / ``kfac_factors_from_inputs`` read the recorded output's values
    #: (False: its shape at most; a capture of the user's backward then returns the output without a clone)
    reads_output_values: bool = True
    #: how K-FAC's parameter matrix ``M`` holds the weight: ``"rows"``, the weight reshaped to ``[rows, cols]``
    #: (Linear, the convolutions, Embedding); another name for another order (a transposed convolution's ``M``
    #: swaps the weight's channel dimensions and flips its kernel). Tied uses of one parameter add their K-FAC
    #: factors only where their layouts agree (:func:`curvature.tied.check_kfac_tied`)
    matrix_layout: str = "rows"

    # ---- parameters -------------------------------------------------------------------
    def covered_params(self, module: nn.Module) -> List[Tuple[str, nn.Parameter]]:
        """Direct parameters that require grad, in ``named_parameters`` order."""
        return [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]

    # ---- normal form ------------------------------------------------------------------
    def kfac_undefined(self, module: nn.Module) -> Optional[str]:
        """Why K-FAC is not defined for ``module`` (a phrase naming it), or None where it is. A family without
        K-FAC has none for any of its modules; one with it may still have none for some configuration (a
        grouped convolution)."""
        return None if self.supports_kfac else f"K-FAC is not defined for {type(module).__name__}"

    def batched_output_dim(self, module: nn.Module) -> Optional[int]:
        """The number of dimensions of a batched call's output where a call without the batch dimension is an
        error (a convolution's ``[N, C, *positions]``: without it the channels would be read as the
        examples); None where any output is taken as it is."""
        return None

    def validate(self, module: nn.Module) -> None:
        """Raise ValueError for a configuration of the layer that is not supported."""

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        """``a`` in normal form (see module docstring). Detached."""
        raise NotImplementedError

    def normal_output_grad(self, module: nn.Module, g: Tensor) -> Tensor:
        """``g`` of shape ``[K, N, *output.shape[1:]]`` -> ``[K, N, T, d_out]``."""
        raise NotImplementedError

    # ---- per-example gradients -----------------------------------------------------------
    def per_example_grads(self, module: nn.Module, a: Tensor, g: Tensor,
                          names: Sequence[str]) -> Dict[str, Tensor]:
        """Per-example gradients ``{name: [K, N, *param.shape]}`` for the covered ``names``."""
        raise NotImplementedError

    def diag_sum(self, module: nn.Module, a: Tensor, g: Tensor, names: Sequence[str]) -> Optional[Tensor]:
        """``Σ_{k,n} (per-example gradient)²`` as ``[P]`` without materializing per-example
        gradients, or None when this family/shape needs them (the engine then falls back)."""
        return None

    # ---- K-FAC ----------------------------------------------------------------------------
    def kfac_factors(self, module: nn.Module, a: Tensor, g: Tensor,
                     names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        """``(L, R)`` Kronecker factors of the block over row-major ``vec(M)``.

        A factor is a symmetric ``[n, n]`` matrix or a 1-D ``[n]`` tensor for a diagonal factor.
        """
        raise NotImplementedError(f"K-FAC is not defined for {type(module).__name__}")

    #: whether :meth:`kfac_output_factor` reads ``a`` (Embedding's padding mask); when False the
    #: engine passes None and never builds the normal-form input for it
    output_factor_needs_input: bool = True

    def kfac_factors_from_inputs(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Optional[Tensor],
                                 g: Tensor, names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        """:meth:`kfac_factors` from the recorded forward (``inputs``: the module's inputs), for
        families with a cheaper route than the normal form (Conv2d: no unfolded patches)."""
        return self.kfac_factors(module, self.normal_input(module, inputs, output), g, names)

    def kfac_input_rows(self, module: nn.Module, inputs: Tuple[Tensor, ...], g: Tensor) -> Union[int, Tensor]:
        """How many rows K-FAC's ``A`` of this call is a mean over: the ``N·T`` positions of the normal-form
        output gradient ``g [K, N, T, d_out]`` (its weight where the factors of several micro-batches or ranks
        are averaged). ``inputs``: the call's recorded inputs."""
        return g.shape[1] * g.shape[2]

    def kfac_output_factor(self, module: nn.Module, a: Optional[Tensor], g: Tensor, names: Sequence[str]) -> Tensor:
        """The output-side factor ``G`` alone. It is a sum over the ``K`` backpropagated vectors,
        so the factors of chunks of ``g [k, N, T, d_out]`` add up to the factor of all of them.
        ``a`` is the normal-form input, or None when :attr:`output_factor_needs_input` is False."""
        left, right = self.kfac_factors(module, a, g, names)
        return left if self.kfac_names()[0] == "G" else right

    def kfac_names(self) -> Tuple[str, str]:
        """Which of ``(L, R)`` is the input-side factor ``A`` and which the output-side ``G``."""
        return ("G", "A")

    def to_matrix(self, module: nn.Module, tensors: Sequence[Tensor], names: Sequence[str]) -> Tensor:
        """Pack per-parameter tensors (param shapes, covered order) into ``M [rows, cols]``."""
        raise NotImplementedError

    def to_matrix_into(self, module: nn.Module, tensors: Sequence[Tensor], names: Sequence[str], out: Tensor) -> None:
        """:meth:`to_matrix` written into ``out [rows, cols]`` (e.g. a view of a padded buffer)."""
        out.copy_(self.to_matrix(module, tensors, names))

    def from_matrix(self, module: nn.Module, matrix: Tensor, names: Sequence[str]) -> List[Tensor]:
        """Inverse of :meth:`to_matrix`."""
        raise NotImplementedError

    def matrix_columns(self, module: nn.Module, names: Sequence[str]) -> Optional[List[Tuple[int, int]]]:
        """``[(start, stop), ...]``: the columns of ``M`` that hold each covered parameter (in
        ``names`` order), each parameter being ``M[:, start:stop]`` reshaped; None when ``M`` is
        not such a column split (then only :meth:`to_matrix` / :meth:`from_matrix` apply)."""
        return None

    def kfac_input_classes(self, module: nn.Module, names: Sequence[str]) -> Optional[Tensor]:
        """A class label per row of K-FAC's input-side factor ``A`` (``[n]``, int64) such that ``A`` is zero by
        construction between rows of different classes (its eigendecomposition is then one per class); None
        where there is no such structure (the default)."""
        return None

    def matrix_shape(self, module: nn.Module, names: Sequence[str]) -> Optional[Tuple[int, int]]:
        """``(rows, cols)`` of ``M`` where the family knows it without building it and :meth:`matrix_columns`
        is None; None otherwise."""
        return None


def pack_columns(tensors: Sequence[Tensor], spans: Sequence[Tuple[int, int]], rows: int) -> Tensor:
    """``M [rows, cols]`` from tensors that are its column ranges ``spans`` (as given by
    :meth:`LayerFamily.matrix_columns`), each reshaped to ``[rows, stop − start]``."""
    blocks = sorted(zip(spans, tensors), key=lambda sb: sb[0][0])  # column order
    parts = [t.reshape(rows, stop - start) for (start, stop), t in blocks]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def channels_last_grad(g: Tensor) -> Tensor:
    """Output gradients of a channels-first layer (a convolution, BatchNorm, GroupNorm), ``[K, N, C, *positions]``,
    in normal form ``[K, N, T, C]`` (a view where the positions flatten without a copy)."""
    k, n, c = g.shape[0], g.shape[1], g.shape[2]
    return g.reshape(k, n, c, -1).transpose(2, 3)


def flat_per_example(grads: Dict[str, Tensor], names: Sequence[str]) -> Tensor:
    """``{name: [K, N, *shape]}`` -> ``[K, N, P]`` concatenated in ``names`` order."""
    parts = [grads[n].reshape(grads[n].shape[0], grads[n].shape[1], -1) for n in names]
    return torch.cat(parts, dim=2)


def feature_rows(x: Tensor) -> Tensor:
    """``x [..., R, d]`` as a ``[d, M]`` matrix (``M`` = all other elements), copied along ``x``'s
    contiguous runs.

    A feature-major layout (``x`` a transposed view of ``[..., d, R]`` storage, as Conv2d's output
    gradients ``[K, N, C, T]`` and unfolded patches ``[N, C·k², T]`` are) is moved with ``movedim``:
    its copy keeps the ``R`` runs (8 channels × 64 positions × 128 examples: 59 µs for the whole
    Gram matrix instead of 194 µs for a row-major reshape that gathers one float per stride).
    Otherwise ``x.reshape(-1, d).t()`` (a view when ``x`` is contiguous)."""
    d = x.shape[-1]
    if x.dim() >= 2 and x.shape[-2] > 1 and x.stride(-2) == 1 and x.stride(-1) != 1:
        return x.transpose(-1, -2).movedim(-2, 0).reshape(d, -1)
    return x.reshape(-1, d).t()


def gram(m: Tensor, scale: float = 1.0) -> Tensor:
    """``scale · m mᵀ`` for ``m [d, M]``: ``[d, d]``. The scale goes on the smaller of the operand
    and the result (a wide layer at a small batch, ``M < d``: on the operand — a separate division
    of the result was a third of the factor's time; ``M > d``: on the ``[d, d]`` result)."""
    if scale == 1.0:
        return m @ m.t()
    if m.shape[1] > m.shape[0]:
        return (m @ m.t()).mul_(scale)
    return (m * scale) @ m.t()


def sum_outer(x: Tensor, scale: float = 1.0) -> Tensor:
    """``scale · Σ_i x_i x_iᵀ`` for ``x`` of shape ``[..., d]`` (all leading dims summed): ``[d, d]``."""
    return gram(feature_rows(x), scale)


def sum_outer_with_ones(x: Tensor, scale: float = 1.0) -> Tensor:
    """:func:`sum_outer` of ``[x, 1]`` (:func:`ones_column`: the bias as a constant input): ``[d + 1, d + 1]``.
    A feature-major ``x`` gets its ones as a row of :func:`feature_rows` (no row-major copy of ``x``)."""
    m = feature_rows(x)
    if m.stride(-1) == 1:  # feature-major: rows are contiguous, append the constant row
        return gram(torch.cat([m, m.new_ones(1, m.shape[1])]), scale)
    return sum_outer(ones_column(x), scale)


def ones_column(a: Tensor) -> Tensor:
    """Append a column of ones on the last dim: ``[..., d] -> [..., d + 1]`` (bias as an input)."""
    return torch.cat([a, a.new_ones(a.shape[:-1] + (1,))], dim=-1)
