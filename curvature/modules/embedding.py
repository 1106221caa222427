"""nn.Embedding: a Linear layer on one-hot inputs.

Normal form: ``a = indices [N, T]`` (long), ``g [K, N, T, D]``. Per-example gradient of the
weight ``[V, D]``: ``Σ_t e_{i_t} g_tᵀ`` (rows at ``padding_idx`` stay zero).

K-FAC (Kronecker order ``A ⊗ G`` over row-major ``vec(W)``, W of shape ``[V, D]``):
``A = diag((1/M) Σ_{n,t} e_{i_nt})`` — a *diagonal* factor stored as a 1-D ``[V]`` tensor
(one-hot inputs are orthogonal) — and ``G = (1/N) Σ_{k,n,t} g gᵀ`` ``[D, D]``, both over the
``M`` positions whose index is not ``padding_idx`` (``M = N·T`` without one): a padding position
reaches no row of the weight, so it is left out of both (K-FAC = the full block for one example).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import GradientsDoNotHelp, LayerFamily, SkipDoesNotHelp, sum_outer


class EmbeddingFamily(LayerFamily):
    """``nn.Embedding``: the weight ``[V, d]``; an example's ``T`` tokens each select a row (K-FAC: a
    diagonal ``[V]`` input factor of the token counts, a ``[d, d]`` output-gradient factor)."""

    module_types = (nn.Embedding,)
    supports_kfac = True
    kfac_diagonal_left = True

    def validate(self, module: nn.Module) -> None:
        if module.sparse:
            raise SkipDoesNotHelp("Embedding(sparse=True) is not supported; use sparse=False (the optimizers need "
                                  "dense gradients for every parameter they update, a skipped module's included; or "
                                  "update its weight with torch.optim.SparseAdam and leave it out of their params)")
        if module.max_norm is not None:
            raise GradientsDoNotHelp(
                "Embedding(max_norm=...) renormalizes rows of its weight in place in forward, which no curvature "
                "describes (under VIOptimizer it would renormalize a weight sample, never the mean, and a forward at "
                "the mean would rewrite the posterior mean); drop max_norm (renormalize the rows after the step)")
        if module.scale_grad_by_freq:
            raise GradientsDoNotHelp(
                "Embedding(scale_grad_by_freq=True) divides each row's gradient by its token count in the batch, a "
                "gradient that is not the derivative of the loss (no curvature kind or estimate from the gradients "
                "matches it); use scale_grad_by_freq=False")

    def normal_input(self, module: nn.Module, inputs: Tuple[Tensor, ...], output: Tensor) -> Tensor:
        idx = inputs[0].detach()
        return idx.reshape(idx.shape[0], -1) if idx.dim() > 0 else idx.reshape(1, 1)

    def normal_output_grad(self, module: nn.Module, g: Tensor) -> Tensor:
        return g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1])

    def _one_hot(self, module: nn.Module, a: Tensor, dtype: torch.dtype) -> Tensor:
        oh = F.one_hot(a.long(), module.num_embeddings).to(dtype)  # [N, T, V]
        if module.padding_idx is not None:
            oh[..., module.padding_idx] = 0
        return oh

    def per_example_grads(self, module: nn.Module, a: Tensor, g: Tensor,
                          names: Sequence[str]) -> Dict[str, Tensor]:
        oh = self._one_hot(module, a, g.dtype)
        return {"weight": torch.einsum("ntv,kntd->knvd", oh, g)}

    def diag_sum(self, module: nn.Module, a: Tensor, g: Tensor, names: Sequence[str]) -> Optional[Tensor]:
        """``Σ_{k,n} (per-example gradient)²`` as ``[V·D]`` without the ``[K, N, V, D]`` per-example tensor
        (``Embedding(50000, 64)`` at 64×16 tokens: 2.4 GB and seconds): an example's gradient is nonzero in
        the rows of its distinct tokens only, each the sum of ``g`` over that token's positions. Those
        sums (``[K, U, D]``, ``U ≤ N·T`` distinct (example, token) pairs) are squared, summed over ``k``
        and added into their rows; the padding row stays zero."""
        if list(names) != ["weight"]:
            return None
        k, n, t, d = g.shape
        v = module.num_embeddings
        tokens = a.reshape(n, t).long()
        key = (torch.arange(n, device=a.device).unsqueeze(1) * v + tokens).reshape(-1)  # (example, token)
        pairs, where = torch.unique(key, return_inverse=True)
        sums = g.new_zeros(k, pairs.numel(), d).index_add_(1, where, g.reshape(k, n * t, d))
        out = g.new_zeros(v, d).index_add_(0, pairs % v, sums.pow(2).sum(0))
        if module.padding_idx is not None:
            out[module.padding_idx] = 0
        return out.reshape(-1)

    def kfac_factors(self, module: nn.Module, a: Tensor, g: Tensor,
                     names: Sequence[str]) -> Tuple[Tensor, Tensor]:
        if "weight" not in names:
            raise ValueError("K-FAC for Embedding needs a trainable weight")
        n, t = a.shape[0], a.shape[1]
        # token counts, not a [N, T, V] one-hot (V = 30k and N·T = 4096 would be 0.5 GB of floats)
        # A = counts / M over the M positions G sums: a padding position reaches no row (G leaves it out),
        # so M counts the others (K-FAC = the full block for one example; dividing by N·T shrank the block
        # by the share of real tokens)
        counts = torch.bincount(a.reshape(-1).long(), minlength=module.num_embeddings).to(g.dtype)
        if module.padding_idx is None:
            return counts.div_(n * t), self.kfac_output_factor(module, a, g, names)
        # a tensor (no host sync on a GPU), in float32 (a float16 count of more than 65504 tokens is inf)
        positions = (n * t - counts[module.padding_idx].to(torch.float32)).clamp_min(1.0)
        counts[module.padding_idx] = 0
        return counts.div_(positions), self.kfac_output_factor(module, a, g, names)

    def kfac_input_rows(self, module: nn.Module, inputs: Tuple[Tensor, ...], g: Tensor) -> Union[int, Tensor]:
        """The positions ``A`` averages: the non-padding ones (a 0-dim integer tensor: no host sync)."""
        if module.padding_idx is None:
            return g.shape[1] * g.shape[2]
        return (inputs[0] != module.padding_idx).sum()

    def kfac_output_factor(self, module: nn.Module, a: Optional[Tensor], g: Tensor, names: Sequence[str]) -> Tensor:
        if module.padding_idx is not None:
            assert a is not None, "Embedding's G needs the token indices (padding mask)"
            g = g * (a != module.padding_idx).to(g.dtype).unsqueeze(0).unsqueeze(-1)
        return sum_outer(g, 1.0 / g.shape[1])

    def kfac_names(self) -> Tuple[str, str]:
        return ("A", "G")

    def to_matrix(self, module: nn.Module, tensors: Sequence[Tensor], names: Sequence[str]) -> Tensor:
        return tensors[0].reshape(module.weight.shape)

    def from_matrix(self, module: nn.Module, matrix: Tensor, names: Sequence[str]) -> List[Tensor]:
        return [matrix.reshape(module.weight.shape)]
