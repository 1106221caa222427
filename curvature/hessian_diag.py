"""Exact diagonal of a Linear or convolution (transposed, grouped) block of the Hessian from Hessian-vector
products in the module's *output* space: ``d_out·T`` products instead of one per parameter.

For a layer whose output is affine in its parameters, ``z_n = W a_n + b`` (per example ``n`` and
position ``t``: ``z_{n,t} = W a_{n,t} + b``), the second derivative of ``z`` in ``W`` is zero, so
the Hessian block of the loss is exactly ``Jᵀ H_zz J`` with ``H_zz = ∂²L/∂z²`` (no residual term
*inside* the block). When no operation after the layer mixes the examples of a batch, ``H_zz``
is block-diagonal over examples, and one Hessian-vector product with the unit vector of output
channel ``o`` at position ``t`` broadcast over all examples returns column ``(o, t)`` of every
example's block ``H_n`` at once. With ``B_o[n, s, t] = H_n[(o, s), (o, t)]``::

    H[W_oj, W_oj] = Σ_n Σ_{s,t} a_{n,s,j} a_{n,t,j} B_o[n, s, t]
    H[b_o, b_o]   = Σ_n Σ_{s,t} B_o[n, s, t]

Cost: ``d_out·T`` output-space products (``d_out`` for a Linear layer on ``[N, d_in]``), against
``d_out·d_in`` parameter-space products for the generic path. A model whose batch statistics
couple the examples (a BatchNorm using batch statistics) does not satisfy the assumption: the
caller then uses the generic path, and so it does wherever the assumptions are not checked to hold
(:func:`uses_only_through`: the parameters reach the loss only through this call of the module,
no tied or functional other use; :func:`rows_independent`: ``H_zz`` has no block coupling two
indices of ``z``'s first dimension — examples coupled by functional batch statistics, a layer
applied to sequence-first ``[T, N, d]`` activations whose positions are mixed afterwards).
"""
from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .blocks.base import compute_dtype
from .hvp import ProductRunner
from .modules.linear import WeightMatrixFamily
from .uses import nodes_reach, reaches

#: output-space unit vectors per batched Hessian-vector product
CHUNK = 128
#: elements of one ``[o-chunk, N, T, T]`` slab of ``B`` held at once
SLAB_ELEMENTS = 1 << 24

#: the convolutions whose output is ``[N, C, *spatial]``, channels before the positions
CONV_TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def supports(module: nn.Module, family: object, output: Tensor) -> bool:
    """Linear (output ``[N, ..., d_out]``) or a convolution (output ``[N, C, *positions]``): ``W a + b``
    per position; a call on no rows (a mixture-of-experts expert nothing was routed to) takes the general path
    (a zero block)."""
    if not isinstance(family, WeightMatrixFamily) or not isinstance(output, Tensor) or output.numel() == 0:
        return False
    if isinstance(module, CONV_TYPES):  # batched calls only: [N, C, *positions]
        return output.dim() == family.batched_output_dim(module)
    return isinstance(module, nn.Linear) and output.dim() >= 2


def output_space_count(module: nn.Module, output: Tensor) -> int:
    """How many output-space products :func:`diag_block` needs: ``d_out·T``."""
    return output[0].numel() if output.dim() > 1 else output.numel()


def _to_ntd(module: nn.Module, z: Tensor, lead: int = 0) -> Tensor:
    """Output ``z`` (after ``lead`` batch dimensions) as ``[*lead, N, T, d_out]``."""
    core = z.shape[lead:]
    if isinstance(module, CONV_TYPES):
        return z.reshape(*z.shape[:lead], core[0], core[1], -1).transpose(-1, -2)  # [.., N, HW (L), C]
    return z.reshape(*z.shape[:lead], core[0], -1, core[-1])


def _from_ntd(module: nn.Module, v: Tensor, shape: torch.Size) -> Tensor:
    """Inverse of :func:`_to_ntd` for a batch ``v [B, N, T, d_out]`` → ``[B, *shape]``."""
    if isinstance(module, CONV_TYPES):
        return v.transpose(-1, -2).reshape(v.shape[0], *shape)
    return v.reshape(v.shape[0], *shape)


def _hvp(runner: ProductRunner, vectors: Tensor) -> Tensor:
    """``[B, *z.shape]`` products ``H_zz v``."""
    return runner.run(vectors)[0]


def uses_only_through(loss: Tensor, z: Tensor, params: Iterable[Tensor], input_nodes: Sequence[Any] = ()) -> bool:
    """Whether ``loss`` depends on ``params`` only through ``z`` as the module's own parameters: no
    path of ``loss``'s autograd graph reaches a parameter's gradient accumulator without passing
    ``z``'s node (a tied module or a functional use of the weight after the call is such a path), and
    the module's inputs (``input_nodes``, their autograd nodes) do not depend on them (a use before
    the call: the fast path takes the inputs as constants). Walks of the graph above ``z`` and
    below the inputs."""
    params = list(params)
    if input_nodes and nodes_reach(input_nodes, params):
        return False
    if z.grad_fn is None or loss.grad_fn is None:
        return True
    return not reaches(loss, params, stop=z.grad_fn)


def rows_independent(runner: ProductRunner, z: Tensor) -> bool:
    """Whether ``H_zz`` (``runner``: products with it) couples no two indices of ``z``'s first dimension,
    checked by two products with one random vector ``w``: ``H(c ⊙ w)`` against ``c ⊙ H w`` for random
    Gaussian weights ``c`` over that dimension. Without coupling they are equal; a coupling ``H_ij``
    (``i ≠ j``) adds ``Σ_j (c_j − c_i)·H_ij w_j`` to row ``i``, which continuous random ``c`` and ``w``
    make nonzero with probability 1 (no pair of rows escapes, as it could under sign patterns). The
    tolerance is a few dozen ulps of the products' scale (a coupling below it changes the diagonal
    by about that much: rounding); the draws are seeded, the same check every call."""
    n = z.shape[0]
    if n < 2:
        return True
    if torch.finfo(z.dtype).bits < 32:  # half precision: its rounding would hide any coupling
        return False
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(z.shape, generator=gen, dtype=torch.float64)
    c = torch.randn((n,) + (1,) * (z.dim() - 1), generator=gen, dtype=torch.float64)
    probes = torch.stack([w, c * w]).to(dtype=z.dtype, device=z.device)
    hv = _hvp(runner, probes).to(torch.float64)
    expected = c.to(hv.device) * hv[0]
    scale = max(float(hv[1].abs().max()), float(expected.abs().max()))
    if scale == 0.0:
        return True
    return float((hv[1] - expected).abs().max()) <= ROWS_TOLERANCE_ULPS * torch.finfo(z.dtype).eps * scale


#: ulps of the products' scale within which the rows test takes them as equal: a float32 MLP's last, short batch
#: (29 rows) came out 73 ulps apart at 64 (rows that are independent); a statistic over the batch couples rows
#: by about 1/N of the scale, above this tolerance for batches of up to ~30,000 rows
ROWS_TOLERANCE_ULPS = 256


def _weight_diag(a: Tensor, b: Tensor, groups: int) -> Tensor:
    """The weight's diagonal ``[d, D]`` (rows of the parameter matrix) from the patches ``a [N, T, G·D]`` and
    ``B [d, N, T, T]``: row ``o`` of group ``g`` (``groups`` of them; 1 but for a grouped convolution) reads
    features ``g·D … (g + 1)·D``, ``H[W_oj, W_oj] = Σ_n Σ_{s,t} a_{n,s,gD+j} a_{n,t,gD+j} B_o[n, s, t]``; a slab
    of one group's rows at a time (:data:`SLAB_ELEMENTS`)."""
    n, t = a.shape[:2]
    rows = b.shape[0] // groups
    ag = a.reshape(n, t, groups, -1)  # [N, T, G, D]: views of a
    if t == 1:
        return torch.cat([torch.einsum("nj,on->oj", ag[:, 0, g].pow(2), b[g * rows:(g + 1) * rows, :, 0, 0])
                          for g in range(groups)])
    step = max(1, SLAB_ELEMENTS // max(1, n * t * t))
    return torch.cat([torch.einsum("nsj,ntj,onst->oj", ag[:, :, g], ag[:, :, g],
                                   b[g * rows + o:g * rows + min(o + step, rows)])
                      for g in range(groups) for o in range(0, rows, step)])


def diag_block(loss: Tensor, module: nn.Module, family: WeightMatrixFamily, inputs: Tuple[Tensor, ...], z: Tensor,
               names: List[str]) -> Optional[Tensor]:
    """The exact Hessian diagonal ``[P]`` of ``module``'s ``names`` parameters (in that order, each
    row-major); a zero-size tensor when ``z`` is not in ``loss``'s graph at second order; None when
    ``H_zz`` couples the indices of ``z``'s first dimension (:func:`rows_independent`: the caller
    takes the generic path).

    ``family``: the module's layer family (its unfolded patches, for a convolution); ``inputs``: the module's
    recorded inputs; ``z``: its recorded output (in the graph of ``loss``,
    the only way the parameters reach it: :func:`uses_only_through`).
    """
    (gz,) = torch.autograd.grad(loss, z, create_graph=True, allow_unused=True)
    if gz is None or not gz.requires_grad:
        return z.new_zeros(0)
    zn = _to_ntd(module, z.detach())                               # [N, T, d]
    n, t, d = zn.shape
    if isinstance(module, CONV_TYPES):
        a = family.normal_input(module, inputs, z)  # [N, T, C·kh·kw] unfolded patches
    else:
        x = inputs[0].detach()
        a = x.reshape(n, t, x.shape[-1])
    wide = compute_dtype(gz.dtype)  # the squares and sums in float32 or wider (x² overflows float16 at |x| > 256)
    a = a.to(wide)
    runner = ProductRunner(gz, [z])
    if not rows_independent(runner, z):
        return None
    cols = [(o, s) for o in range(d) for s in range(t)]           # column (channel o, position s)
    b = torch.empty(d, n, t, t, dtype=wide, device=gz.device)  # B_o[n, s', s]
    for start in range(0, len(cols), CHUNK):
        chunk = cols[start:start + CHUNK]
        v = torch.zeros(len(chunk), n, t, d, dtype=gz.dtype, device=gz.device)
        idx = torch.arange(len(chunk))
        o_idx = torch.tensor([o for o, _ in chunk])
        s_idx = torch.tensor([s for _, s in chunk])
        v[idx, :, s_idx, o_idx] = 1.0
        hv = _to_ntd(module, _hvp(runner, _from_ntd(module, v, z.shape)), lead=1)  # [B, N, T, d]
        b[o_idx, :, :, s_idx] = hv[idx, :, :, o_idx]                  # [B, N, T] -> B_o[:, :, s]
    parts = {}  # over the parameter matrix M = [W | b] (the family's layout), then cut into the parameters
    if "weight" in names:  # (a grouped convolution's output channel reads its group's features only)
        parts["weight"] = _weight_diag(a, b, getattr(module, "groups", 1))
    if "bias" in names:
        parts["bias"] = b.sum(dim=(1, 2, 3)).unsqueeze(1)
    m = torch.cat([parts[k] for k in ("weight", "bias") if k in parts], dim=1)
    return torch.cat([p.reshape(-1) for p in family.from_matrix(module, m, names)]).detach()
