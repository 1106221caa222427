"""Batches of Hessian-vector products, batched through ``is_grads_batched`` or one at a time —
whichever is faster for the graph at hand.

``torch.vmap``'s batching rules make the batched double backward ~2.5× faster than a loop on
Linear/ReLU graphs, but ~6× slower through Conv2d / max-pool double backward on a CPU. A
:class:`ProductRunner` times both on its first chunks (the loop on a few vectors, the batched path
twice on chunk-sized batches: its first call pays a one-time set-up) and keeps the faster one; an op without a batching rule falls back to
the loop.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence

import torch
from torch import Tensor

#: vectors per timing probe while the runner has not chosen
PROBE = 16


class ProductRunner:
    """``run(vectors)`` = ``torch.autograd.grad(outputs, inputs, grad_outputs=vectors[i])`` stacked over
    ``i`` (``vectors``: ``[B, *outputs.shape]``), returned per input as ``[B, *input.shape]``
    (zeros for an input the outputs do not depend on)."""

    def __init__(self, outputs: Tensor, inputs: Sequence[Tensor]) -> None:
        self.outputs, self.inputs = outputs, list(inputs)
        self.per_vector = {"loop": [], "batched": []}  # seconds per product of each timed chunk
        self.choice: Optional[str] = None

    def _zeros(self, grads: Sequence[Optional[Tensor]], b: int) -> List[Tensor]:
        return [g if g is not None else torch.zeros((b,) + q.shape, dtype=self.outputs.dtype, device=q.device)
                for g, q in zip(grads, self.inputs)]

    def _batched(self, vectors: Tensor) -> List[Tensor]:
        g = torch.autograd.grad(self.outputs, self.inputs, grad_outputs=vectors, is_grads_batched=True,
                                retain_graph=True, allow_unused=True)
        return self._zeros(g, vectors.shape[0])

    def _loop(self, vectors: Tensor) -> List[Tensor]:
        rows = []
        for v in vectors:
            g = torch.autograd.grad(self.outputs, self.inputs, grad_outputs=v, retain_graph=True, allow_unused=True)
            rows.append([x if x is not None else torch.zeros_like(q) for x, q in zip(g, self.inputs)])
        return [torch.stack([r[i] for r in rows]) for i in range(len(self.inputs))]

    def _method(self) -> str:
        if self.choice is not None:
            return self.choice
        if not self.per_vector["loop"] or len(self.per_vector["batched"]) < 2:
            return "undecided"
        self.choice = "batched" if min(self.per_vector["batched"]) < min(self.per_vector["loop"]) else "loop"
        return self.choice

    def _do(self, method: str, vectors: Tensor) -> List[Tensor]:
        if method == "batched":
            try:
                return self._batched(vectors)
            except RuntimeError:  # an op without a batching rule
                self.choice = "loop"
        return self._loop(vectors)

    def _agrees(self, batched: List[Tensor], vectors: Tensor) -> bool:
        """Whether the batched products of ``vectors`` are right: their combination with fixed weights
        ``c_i`` equals the loop's product of ``Σ c_i v_i`` (linearity; one product checks every row) to ``√eps``
        of the terms' size. torch 2.13's batched double backward through ``native_group_norm`` is silently
        wrong for a batch of one example (it raises for more, and the loop takes over)."""
        # seeded Gaussian weights (a local generator: the global random stream is not touched)
        c = torch.randn(vectors.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        want = self._loop(torch.tensordot(c.to(vectors.dtype).to(vectors.device), vectors, dims=1).unsqueeze(0))
        for rows, w in zip(batched, want):
            if not rows.is_floating_point() or rows.numel() == 0:
                continue
            cw = c.to(device=rows.device, dtype=rows.dtype)
            size = float(torch.dot(cw.abs(), rows.flatten(1).abs().amax(1)))  # Σ|c_i|·max|row_i|: the terms' size
            got = torch.tensordot(cw, rows, dims=1)
            if not bool(((got - w[0]).abs() <= torch.finfo(rows.dtype).eps ** 0.5 * size).all()):
                return False
        return True

    def run(self, vectors: Tensor) -> List[Tensor]:
        # contiguous: torch 2.13's instance_norm and eval batch_norm backward take a strided grad_output of a
        # one-example batch wrongly (hessian_diag's unit vectors are channels-last views)
        vectors = vectors.contiguous()
        if self.choice is not None:
            return self._do(self.choice, vectors)
        parts, i, b = [], 0, vectors.shape[0]
        if not self.per_vector["loop"]:  # the loop on PROBE vectors (the first one untimed: warm-up)
            seg = vectors[:PROBE]
            parts.append(self._do("loop", seg[:1]))
            t0 = time.perf_counter()
            if seg.shape[0] > 1:
                parts.append(self._do("loop", seg[1:]))
                self.per_vector["loop"].append((time.perf_counter() - t0) / (seg.shape[0] - 1))
            i = seg.shape[0]
        if i < b and self.choice is None:  # the batched path on the rest of the chunk (chunk-sized batches)
            t0 = time.perf_counter()
            batched = self._do("batched", vectors[i:])
            if self.choice is None:
                self.per_vector["batched"].append((time.perf_counter() - t0) / (b - i))
                if not self.per_vector["batched"][1:] and not self._agrees(batched, vectors[i:]):  # checked once
                    self.choice = "loop"
                    batched = self._loop(vectors[i:])
                else:
                    self._method()
            parts.append(batched)
        elif i < b:
            parts.append(self._do(self.choice, vectors[i:]))
        return [torch.cat([part[k] for part in parts]) for k in range(len(self.inputs))]
