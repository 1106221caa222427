"""Sequence outputs: loss rows that are positions inside the covered modules' examples.

A language model's ``[N, T, C]`` logits reshaped to ``[N·T, C]`` (``out.reshape(-1, C)``, in the
model or with ``output_selector``) give the loss ``R = N·T`` rows while every covered module sees
``N`` examples (its output ``[N, T, d]``). Row ``r`` belongs to module example ``r // T``
(example-major rows, as ``reshape`` of a batch-first output gives them; checked with one backward
pass, :func:`check_example_major_rows`).

The per-example quantity is the sequence: with ``ℓ_nt`` the loss of row ``(n, t)`` and the loss
``(1/R) Σ_{n,t} ℓ_nt`` (the mean over rows, as ``F.cross_entropy`` computes it),

* ``fisher`` (= GGN): ``(1/R) Σ_n Σ_t J_ntᵀ H_nt J_nt``, exact. The ``K`` columns ``s_k`` of each
  row's output-Hessian factor are backpropagated *per position*: vector ``(k, t)`` holds ``s_k`` at
  the rows of position ``t`` and zeros elsewhere (:func:`per_position_vectors`), so an example's
  gradient for it is ``J_ntᵀ s_ntk`` alone, never a sum over its rows: ``T·K`` backward passes
  (BackPACK backpropagates the same ``T·C`` columns for a sequence cross-entropy). K-FAC blocks of the
  exact Fisher use the same vectors (K-FAC-expand of the GGN: no cross terms between rows).
* ``empirical_fisher``: ``(1/R) Σ_n g_n g_nᵀ`` with ``g_n = ∇_θ Σ_t ℓ_nt`` the gradient of the
  sequence's summed token losses (one backward pass; for ``T = 1`` the usual definition). Its K-FAC
  blocks are K-FAC-expand of that (``G`` sums ``∂(Σ_t ℓ_nt)/∂s_nt'`` outer products over positions ``t'``).
  Taken from the user's own backward (the optimizers' ``empirical_fisher`` without targets) the
  row layout cannot be checked (no backward pass of the engine's own).
* ``fisher_mc`` keeps one vector per sample: the sampled rows' gradients are independent and
  zero-mean, so the cross terms vanish in expectation (unbiased, not exact).
"""
from __future__ import annotations

from collections import Counter
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .options import Approx, Kind


def rows_per_example(kind: Kind, rows: int, batches: Mapping[str, int], approx: Mapping[str, Optional[Approx]]) -> int:
    """How many loss rows each module example holds (``T``; 1 when every module example is one row).

    ``batches``: each recorded covered module's batch (first) dimension. For the kinds that are sums
    of per-example products (``fisher``, ``empirical_fisher``) the modules whose batch differs from
    ``rows`` must share one batch ``N`` dividing ``rows``; ValueError otherwise. Modules in K-FAC
    shape under the empirical Fisher keep the per-row K-FAC-expand convention (any batch: a
    sequence-first ``[T, N, d]`` layout is fine there); sizes alone cannot tell such a module from one
    whose rows the examples share (a position embedding on ``torch.arange(T)``), which is not detected
    for them (docs/guide.md)."""
    if kind not in (Kind.FISHER, Kind.EMPIRICAL_FISHER):
        return 1
    other = {n: b for n, b in batches.items() if b != rows}
    if kind is Kind.EMPIRICAL_FISHER:
        other = {n: b for n, b in other.items() if approx.get(n) is not Approx.KFAC}
    if not other:
        return 1
    counts = Counter(other.values())
    n = max(counts, key=lambda b: (counts[b], b))  # the batch most of those modules see
    bad = {m: b for m, b in other.items() if b != n}
    if bad or n == 0 or rows % n:
        raise ValueError(
            f"kind={kind.value!r} with {rows} loss rows needs every covered module to see either one example per "
            f"row or the same number N of examples with N dividing the rows (sequence logits [N, T, C] reshaped "
            f"to [N*T, C]); the covered modules see batches of {bad or other}"
            f"{f' (the others {sorted(m for m in other if m not in bad)} see {n})' if bad else ''}. A module called without the batch "
            "dimension (e.g. a position embedding on torch.arange(T), broadcast over the batch) has no per-example "
            "gradients: call it on the batch (pos(torch.arange(T).expand(N, T))) or skip it with skip_modules; "
            "sequence-first activations [T, N, d] (nn.TransformerEncoderLayer or nn.MultiheadAttention with "
            "batch_first=False) have the positions first: build them with batch_first=True. Sequences with "
            "different numbers of loss rows (a padding mask, out[mask]) and the other cases: use kind='fisher_mc'")
    return rows // n


def check_example_major_rows(outputs: Tensor, module_outputs: Dict[str, Tensor], per_example: int,
                             every_example: bool = False) -> None:
    """ValueError unless the first ``per_example`` loss rows reach only the first example of every
    module in ``module_outputs`` (their batch is ``rows // per_example``): one backward pass of random
    weights on those rows. Catches rows that are not example-major (a seq-first ``[T, N, C]``
    output reshaped to rows, or a model mixing its examples, where the first example's path reaches the
    mixing: ``every_example`` for the rest).

    ``every_example``: check every example's rows, ``r // T`` for row ``r`` (what the exact Fisher's
    per-position vectors assume), in ``2·⌈log₂ N⌉`` backward passes: for each bit ``b`` of the example
    index, the rows of the examples with that bit set (and then unset) must not reach an example with
    it unset (set). A row of example ``m`` taken as one of example ``n ≠ m`` differs from it in some
    bit and is caught there. Catches sequences with different numbers of rows (a padding mask,
    ``out[mask]``, whose count happens to be a multiple of ``N``), which the first rows alone can pass."""
    leaked = leaking_modules(outputs, module_outputs, per_example, every_example)
    if not leaked:
        return
    examples = outputs.shape[0] // per_example
    if per_example == 1:
        raise ValueError(
            f"the loss of an example reaches other examples' entries of the first dimension of modules {leaked}: "
            "the exact Fisher (every shape) and the empirical Fisher (full and diagonal blocks) take that "
            "dimension as the examples, so it must hold them (e.g. not a sequence-first [T, N, d] activation "
            "of a batch-first model, nor a module broadcast over the examples such as a position embedding on "
            "torch.arange(T) with T == N: call it on torch.arange(T).expand(N, T)) and the model must not mix "
            "its examples. Use kind='fisher_mc', or kind='empirical_fisher' with approx='kfac' for a "
            "sequence-first layout")
    raise ValueError(
        f"the loss rows of an example (taken as {per_example} consecutive rows of {examples} examples) reach other "
        f"examples of modules {leaked}: the rows must be example-major, row r belonging to example r // T, "
        "every example with the same T rows (e.g. logits [N, T, C] of a batch-first model reshaped with "
        "out.reshape(-1, C)), and the model must not mix its examples. Sequences with different numbers of "
        "rows (a padding mask, out[mask]) are not supported here: use kind='fisher_mc' (SecondOrderOptimizer's "
        "default), which takes any mask")


def leaking_modules(outputs: Tensor, module_outputs: Dict[str, Tensor], per_example: int,
                    every_example: bool = False) -> List[str]:
    """The modules of ``module_outputs`` that the loss rows of one example reach at another example
    (the test of :func:`check_example_major_rows`; empty when none)."""
    examples = outputs.shape[0] // per_example
    names = [n for n, o in module_outputs.items() if o.requires_grad and o.shape[0] > 1 and o.shape[0] == examples]
    if not names:
        return []
    index = torch.arange(examples, device=outputs.device)
    if every_example and examples > 1:
        masks = [(index >> b) & 1 == bit for b in range(max(1, (examples - 1).bit_length())) for bit in (1, 0)]
    else:
        masks = [index == 0]
    # random weights on the rows (seeded: the same test every call), not ones: a model whose Jacobian maps the
    # ones vector to zero (an output centred over the classes) would pass a mixing layout unseen
    gen = torch.Generator(device=outputs.device).manual_seed(0)
    weights = torch.randn(outputs.shape, generator=gen, device=outputs.device).to(outputs.dtype)
    for on in masks:
        v = torch.zeros_like(outputs)
        rows = on.repeat_interleave(per_example)
        v[rows] = weights[rows]
        grads = torch.autograd.grad(outputs, [module_outputs[n] for n in names], grad_outputs=v,
                                    retain_graph=True, allow_unused=True)
        leaked = [n for n, g in zip(names, grads) if g is not None and bool(g[~on].ne(0).any())]
        if leaked:
            return leaked
    return []


def rows_mixing_examples(outputs: Tensor, module_outputs: Dict[str, Tensor], rows: Sequence[int] = (0, -1)
                         ) -> List[str]:
    """The modules of ``module_outputs`` (``[B, ...]``) at more than one of whose first-dimension entries
    a single loss row of ``outputs [R, ...]`` arrives (rows ``rows``, one backward pass each; empty when
    none). A loss row is one example's, so where the first dimension holds the examples it reaches one
    entry: the test of :func:`check_reduce_layout` when the rows cannot be attributed to examples (a
    padding mask's rows, uneven per example)."""
    names = [n for n, o in module_outputs.items() if o.requires_grad and o.shape[0] > 1]
    for r in rows:
        v = torch.zeros_like(outputs)
        v[r] = 1
        grads = torch.autograd.grad(outputs, [module_outputs[n] for n in names], grad_outputs=v,
                                    retain_graph=True, allow_unused=True)
        leaked = [n for n, g in zip(names, grads)
                  if g is not None and int(g.reshape(g.shape[0], -1).ne(0).any(1).sum()) > 1]
        if leaked:
            return leaked
    return []


def per_position_vectors(vectors: Tensor, per_example: int, group: int) -> Iterator[Tuple[Tensor, Tensor]]:
    """The ``K·T`` per-position vectors of ``vectors [K, R, *out]`` (``T = per_example``, rows
    example-major), in chunks of at most ``group``: vector ``(k, t)`` is ``vectors[k]`` on the rows
    ``{n·T + t}`` and zero elsewhere. Position-major order (all ``k`` of ``t = 0`` first). Yields
    ``(chunk [j, R, *out], positions [j])``."""
    k, rows = vectors.shape[0], vectors.shape[1]
    n, t = rows // per_example, per_example
    v = vectors.reshape(k, n, t, -1)
    total = k * t
    for s in range(0, total, max(1, group)):
        idx = torch.arange(s, min(total, s + group), device=vectors.device)
        ks, ts = idx % k, idx // k
        out = v.new_zeros(idx.shape[0], n, t, v.shape[-1])
        out[torch.arange(idx.shape[0], device=idx.device), :, ts, :] = v[ks, :, ts, :]
        yield out.reshape((idx.shape[0],) + tuple(vectors.shape[1:])), ts


def localized(a: Tensor, g: Tensor, positions: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
    """A position-local module's inputs and output gradients for per-position vectors, with every
    ``(vector, example)`` pair as one example of one position: ``(a' [k·N, 1, ...], g' [1, k·N, 1, d])``,
    or None when the module is not position-local for these vectors.

    ``a [N, T, ...]`` and ``g [k, N, T, d]`` are a module's normal-form input and output gradients for
    the per-position vectors at ``positions [k]``. When every vector's gradient is exactly zero at the
    module's other positions (nothing between the module and the loss mixes positions: the head, the
    MLP after the last attention), example ``n``'s gradient for vector ``j`` is the one term of position
    ``positions[j]``, so the per-example sums need no sum over ``T`` (``T`` times less work)."""
    k, n, t = g.shape[0], g.shape[1], g.shape[2] if g.dim() == 4 else 0
    if t <= 1 or a.shape[:2] != (n, t) or positions.shape[0] != k or bool(positions.ge(t).any()):
        return None  # (a module with fewer positions than the loss, e.g. a shorter cross-attention memory)
    other = torch.ones(k, t, dtype=torch.bool, device=g.device)
    other[torch.arange(k, device=g.device), positions] = False
    if bool(g.pow(2).sum(dim=(1, 3))[other].ne(0).any()):  # one pass (a leak below √tiny would not count)
        return None
    g_own = g[torch.arange(k, device=g.device), :, positions, :]  # [k, N, d]
    a_own = a[:, positions].transpose(0, 1)  # [k, N, ...]
    return (a_own.reshape((k * n, 1) + tuple(a.shape[2:])),
            g_own.reshape(1, k * n, 1, g.shape[-1]))


def check_reduce_layout(outputs: Tensor, examples: Optional[int], linear: Dict[str, Tensor],
                        positional: Dict[str, Tensor]) -> None:
    """ValueError where ``kfac_approx="reduce"`` would not reduce over each example's positions.

    K-FAC-reduce sums a Linear layer's output gradients and averages its inputs over the middle
    dimensions of its ``[B, T, d]`` input, taking the first as the examples. ``outputs``: the loss
    rows ``[R, ...]``; ``examples``: ``N`` when the model gave ``[N, T, C]`` sequence logits (else None);
    ``linear``: the outputs of the Linear layers in K-FAC shape; ``positional``: the outputs of every
    recorded Linear / Embedding / LayerNorm (whose middle dimensions are positions).

    * A Linear on the ``N·T`` rows of reshaped activations (``head(h.reshape(-1, d))``) has no position
      dimension: reduce would treat every row as an example (K-FAC-expand), refused when another module's
      ``[N, T, d]`` output shows that the rows are positions.
    * A Linear whose first dimension is not the examples (a sequence-first ``[T, N, d]`` activation, as
      ``nn.TransformerEncoderLayer(batch_first=False)`` gives its feed-forward layers) would be averaged
      over the batch: refused when its first dimension differs from ``N`` or when the loss rows of its
      first entry reach its other entries (one backward pass, :func:`leaking_modules`). A purely
      position-wise model in the sequence-first layout cannot be told from a batch-first one this way."""
    rows = outputs.shape[0]
    sequences = [o for o in positional.values() if o.dim() >= 3 and 0 < o.shape[0] < rows
                 and o.shape[:-1].numel() == rows]
    flat = [n for n, o in linear.items() if o.dim() == 2 and o.shape[0] == rows]
    if flat and sequences:
        raise ValueError(
            f"kfac_approx='reduce' sums over the positions of each example, but modules {flat} see the {rows} "
            f"rows of reshaped activations ([N*T, d], no position dimension; other modules see "
            f"{list(sequences[0].shape)}), so each row would count as an example (K-FAC-expand): apply them before "
            "the reshape, on the [N, T, d] activations, or use kfac_approx='expand'")
    by_batch: Dict[int, Dict[str, Tensor]] = {}
    for n, o in linear.items():
        if o.dim() >= 3:
            by_batch.setdefault(o.shape[0], {})[n] = o
    for b, mods in by_batch.items():
        wrong = examples is not None and b not in (examples, 1)  # (batch 1: broadcast over the examples)
        if wrong:
            leaked = list(mods)
        elif b <= 1:
            continue
        elif rows % b == 0 and rows // b in (1, *(o.shape[1:-1].numel() for o in mods.values())):
            leaked = leaking_modules(outputs, mods, rows // b)  # the rows are the examples' in equal runs
        else:  # the loss rows of a padding mask (uneven per example) or another selection: which example a
            leaked = rows_mixing_examples(outputs, mods)  # row is, is unknown; a row is one example's
        if leaked:
            raise ValueError(
                f"kfac_approx='reduce' averages a Linear layer's inputs over their middle dimensions, the positions "
                f"of each example, taking the first as the examples; modules {leaked} see "
                f"{list(mods[leaked[0]].shape)} activations whose first dimension is not the examples (a "
                "sequence-first [T, N, d] layout, e.g. nn.TransformerEncoderLayer / nn.TransformerDecoderLayer with "
                "batch_first=False): build the model with batch_first=True, or use kfac_approx='expand'")
