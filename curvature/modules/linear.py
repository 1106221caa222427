"""nn.Linear (and the unfolded-patch form of nn.Conv2d shares these helpers).

Normal form: ``a [N, T, d_in]`` (T = all leading dims between batch and features, 1 for
plain batches), ``g [K, N, T, d_out]``.

K-FAC (Kronecker order ``G ⊗ A`` over row-major ``vec([W | b])``, bias as an extra input of
constant 1, appended as the last column of the parameter matrix):

* ``A = (1/(N·T)) Σ_{n,t} ã_nt ã_ntᵀ`` with ``ã = [a, 1]`` when the bias is covered;
* ``G = (1/N) Σ_{k,n,t} g_knt g_kntᵀ`` (the engine rescales it to ``1/R`` for ``R`` loss rows when one
  example holds several, see :meth:`curvature.engine.CurvatureEngine.blocks_from_grad_chunks`).

A layer whose weight is frozen but whose bias trains has ``M = b`` (one column) and ``A = [[1]]``.

For one example and ``T = 1`` this is exactly the full block (see tests). For ``T > 1``
it is the KFC "expand" approximation (Grosse & Martens 2016).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .base import LayerFamily, pack_columns, sum_outer, sum_outer_with_ones


#: largest per-example-gradient batch ``[n, d_in, K·d_out]`` formed at once by ``diag_sum`` (elements)
DIAG_CHUNK_ELEMENTS = 1 << 22


def _sum_sq_per_example_products(g: Tensor, a: Tensor) -> Tensor:
    """``Σ_{k,n} (g[k, n]ᵀ a[n])²`` for ``g [K, N, T, d_out]``, ``a [N, T, d_in]``: ``[d_out, d_in]``.

    The ``K`` vectors of one example share its input, so they are one product
    ``a[n]ᵀ [g[0, n] … g[K-1, n]]`` (``[d_in, T] @ [T, K·d_out]``), batched over a chunk of examples
    and bounded to :data:`DIAG_CHUNK_ELEMENTS`. The small ``d_in`` of early conv layers goes first:
    MKL's batched GEMM is 3–5× faster that way for ``d_in = 9`` (2 threads: ``[128, 9, 64] @ [128,
    64, 72]`` 0.19 ms vs 0.55–1.1 ms for the other operand orders and layouts), and one product for
    all ``K`` instead of one per vector saves ``K − 1`` rounds of small-op dispatch.
    """
    k_count, n, t, d_out = g.shape
    d_in = a.shape[2]
    # [N, T, K·d_out] view of the [N, K·d_out, T] copy (g is usually a transposed [K, N, d_out, T])
    gk = g.permute(1, 0, 3, 2).reshape(n, k_count * d_out, t).transpose(1, 2)
    at = a.transpose(1, 2)  # [N, d_in, T]
    step = max(1, DIAG_CHUNK_ELEMENTS // max(1, k_count * d_out * d_in))
    total = g.new_zeros(d_in, k_count * d_out)
    for s in range(0, n, step):
        pe = torch.bmm(at[s:s + step], gk[s:s + step])  # [n, d_in, K·d_out]
        total += pe.pow_(2).sum(dim=0)
    return total.view(d_in, k_count, d_out).sum(dim=1).t()


class WeightMatrixFamily(LayerFamily):
    """Shared math of a layer ``y_t = W a_t + b`` applied at ``T`` positions."""

    supports_kfac = True
    reads_output_values = False  # inputs and output gradients only

    def weight_matrix_shape(self, module: nn.Module) -> Tuple[int, int]:
        w = module.weight
        rows = w.shape[0]
        return rows, (w.numel() // rows if rows else 0)  # no w[0] view: this runs on every solve

    def weight_from_rows(self, module: nn.Module, m: Tensor) -> Tensor:
        """The weight part of parameter matrices ``m [..., rows, cols]`` as weights ``[..., *weight.shape]``
        (here a reshape: ``M`` holds the weight row-major)."""
        return m.reshape(m.shape[:-2] + tuple(module.weight.shape))

    def matrix_shape(self, module: nn.Module, names: Sequence[str]) -> Optional[Tuple[int, int]]:
        rows, cols = self.weight_matrix_shape(module)
        return rows, (cols if "weight" in names else 0) + int("bias" in names)

    def per_example_rows(self, module: nn.Module, a: Tensor, g: Tensor) -> Tensor:
        """Per-example weight gradients as parameter-matrix rows ``[K, N, rows, cols]``: ``Σ_t g_t a_tᵀ`` (every row
        reads the whole input; a grouped convolution's rows read their group's part, ``ConvFamily``)."""
        return torch.einsum("kntd,ntj->kndj", g, a.to(g.dtype))

    def per_example_grads(self, module: nn.Module, a: Tensor, g: Tensor,
                          names: Sequence[str]) -> Dict[str, Tensor]:
        out: Dict[str, Tensor] = {}
        if "weight" in names:
            out["weight"] = self.weight_from_rows(module, self.per_example_rows(module, a, g))
        if "bias" in names:
            out["bias"] = g.sum(dim=2)
        return out

    def diag_sum(self, module: nn.Module, a: Tensor, g: Tensor, names: Sequence[str]) -> Optional[Tensor]:
        """``Σ_{k,n} (per-example gradient)²`` as ``[P]`` (the parameters in the order of ``names``, each
        row-major; a layer whose bias was registered first, e.g. after ``remove_parametrizations``,
        has ``("bias", "weight")``).

        ``T = 1``: the per-example weight gradient is the outer product ``g aᵀ``, so
        ``Σ_{k,n} (g aᵀ)² = (Σ_k g²)ᵀ(a²)``: one ``[d_out, N] @ [N, d_in]`` product, no per-example tensor.
        ``T > 1``: the per-example gradients ``g_kn a_nᵀ`` of all ``K`` vectors for one chunk of
        examples at a time (one ``bmm``, bounded to :data:`DIAG_CHUNK_ELEMENTS` elements), squared
        and summed at once: no ``[K, N, P]`` tensor.
        """
        if a.shape[1] == 1:  # Σ_n (Σ_k g²) a²: the K vectors share a, so sum them first
            g2 = g[0, :, 0].pow(2) if g.shape[0] == 1 else g[:, :, 0].pow(2).sum(dim=0)  # [N, d_out]
            d_out, d_in = g2.shape[1], a.shape[-1]
            sizes = {"weight": d_out * d_in, "bias": d_out}
            out = g2.new_empty(sum(sizes[n] for n in names))  # every part written in place: no cat
            start = 0
            for name in names:
                part = out[start:start + sizes[name]]
                if name == "weight":
                    torch.mm(g2.t(), a[:, 0].to(g.dtype).pow(2), out=part.view(d_out, d_in))
                else:  # the bias's per-example gradient is g itself: Σ_{k,n} g² = Σ_n g2
                    torch.sum(g2, dim=0, out=part)
                start += sizes[name]
            return out
        parts = {}
        if "weight" in names:
            parts["weight"] = _sum_sq_per_example_products(g, a.to(g.dtype)).reshape(-1)
        if "bias" in names:
            parts["bias"] = g.sum(dim=2).pow(2).sum(dim=(0, 1))
        return torch.cat([parts[n] for n in names])

    def kfac_factors(self, module: nn.Module, a: Tensor, g: Tensor,
                     names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        n, t = a.shape[0], a.shape[1]
        big_g = self.kfac_output_factor(module, a, g, names)
        if "weight" not in names:  # frozen weight, trainable bias: the input is the constant 1
            return big_g, g.new_ones(1, 1)
        a = a.to(g.dtype)
        return big_g, (sum_outer_with_ones if "bias" in names else sum_outer)(a, 1.0 / (n * t))

    output_factor_needs_input = False

    def kfac_output_factor(self, module: nn.Module, a: Optional[Tensor], g: Tensor, names: Sequence[str]) -> Tensor:
        return sum_outer(g, 1.0 / g.shape[1])

    def matrix_columns(self, module: nn.Module, names: Sequence[str]) -> Optional[List[Tuple[int, int]]]:
        """The one place of the layout ``M = [W | b]``: the weight's columns, then the bias as the
        last column (the only one when the weight is frozen)."""
        _, cols = self.weight_matrix_shape(module)
        span = {"weight": (0, cols), "bias": (cols, cols + 1) if "weight" in names else (0, 1)}
        return [span[n] for n in names]

    def to_matrix(self, module: nn.Module, tensors: Sequence[Tensor], names: Sequence[str]) -> Tensor:
        return pack_columns(tensors, self.matrix_columns(module, names), self.weight_matrix_shape(module)[0])

    def to_matrix_into(self, module: nn.Module, tensors: Sequence[Tensor], names: Sequence[str], out: Tensor) -> None:
        rows, _ = self.weight_matrix_shape(module)
        for t, (start, stop) in zip(tensors, self.matrix_columns(module, names)):
            out[:, start:stop].copy_(t.reshape(rows, stop - start))

    def from_matrix(self, module: nn.Module, matrix: Tensor, names: Sequence[str]) -> List[Tensor]:
        """Views of ``matrix`` (no copies: the weight's columns are contiguous within a row)."""
        res: List[Tensor] = []
        for name, (start, stop) in zip(names, self.matrix_columns(module, names)):
            if name == "weight":
                w = matrix[:, start:stop]
                res.append(w.view(module.weight.shape) if w.stride(-1) == 1 else w.reshape(module.weight.shape))
            else:
                res.append(matrix[:, start])
        return res


class LinearFamily(WeightMatrixFamily):
    """``nn.Linear``: the weight ``[d_out, d_in]`` applied at every position of an ``[N, ..., d_in]`` input
    (``T`` = the product of the middle dimensions)."""

    module_types = (nn.Linear,)

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        x = inputs[0].detach()
        return x.reshape(x.shape[0], -1, x.shape[-1]) if x.dim() > 1 else x.reshape(1, 1, -1)

    def normal_output_grad(self, module: nn.Module, g: Tensor) -> Tensor:
        if g.dim() == 2:  # an unbatched input [in] gave an output [out]: one example, one position
            return g.reshape(g.shape[0], 1, 1, g.shape[-1])
        return g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])
