"""Bucketing: pack many tensors into a few flat buffers, one collective per buffer.

Pure functions, no communication. A *bucket* is a run of tensors that share dtype and
device and whose payload fits in ``cap_bytes``; it is flattened into one contiguous 1-D
buffer, sent through a single collective, and copied back element for element.

Symmetric mode: every tensor is a symmetric ``[n, n]`` matrix and only its upper triangle,
diagonal included, is packed (``n (n + 1) / 2`` elements, row-major). Unpacking writes the
upper triangle and mirrors it into the lower one, so whatever was in the lower triangle
before is overwritten.

The plan depends only on the shapes, dtypes and devices of the tensors and their order, so
every rank that passes the same list builds the same buckets: this is what keeps the
collectives of different ranks matched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MIB: int = 1 << 20
"""Bytes in one MiB; ``bucket_cap_mb`` counts MiB, like ``DistributedDataParallel``."""


@dataclass(frozen=True)
class Bucket:
    """One planned collective.

    Attributes:
        indices: positions (in the caller's list) of the tensors in this bucket, in order.
        numel: number of elements of the flat buffer.
        dtype: dtype shared by every tensor of the bucket.
        device: device shared by every tensor of the bucket.
    """

    indices: tuple[int, ...]
    numel: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        """Payload bytes of the flat buffer."""
        return self.numel * _element_size(self.dtype)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def symmetric_numel(n: int) -> int:
    """Number of elements in the upper triangle (diagonal included) of an ``[n, n]`` matrix."""
    return n * (n + 1) // 2


def check_symmetric_shapes(tensors: Sequence[Tensor]) -> None:
    """Raise ``ValueError`` unless every tensor is a square ``[n, n]`` matrix."""
    for i, t in enumerate(tensors):
        if t.dim() != 2 or t.shape[0] != t.shape[1]:
            raise ValueError(
                f"symmetric=True needs square [n, n] matrices; tensor {i} has shape {tuple(t.shape)}"
            )


def payload_numel(t: Tensor, symmetric: bool) -> int:
    """Elements of ``t`` that go on the wire: the upper triangle if ``symmetric``, else all."""
    return symmetric_numel(t.shape[0]) if symmetric else t.numel()


def plan_buckets(tensors: Sequence[Tensor], cap_bytes: int, symmetric: bool = False) -> list[Bucket]:
    """Group ``tensors`` into buckets of at most ``cap_bytes`` payload bytes.

    Tensors are first grouped by ``(dtype, device)`` (in order of first appearance), then
    each group is filled greedily in list order: a new bucket starts when the next tensor
    would push the current one over the cap. A tensor larger than the cap gets a bucket of
    its own. Empty tensors are skipped.

    Args:
        tensors: the tensors, in the order every rank uses.
        cap_bytes: largest payload of a bucket, in bytes (> 0).
        symmetric: count only the upper triangle of each (square) tensor.

    Returns:
        The buckets; the union of their ``indices`` is every non-empty tensor exactly once.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be positive, got {cap_bytes} bytes")
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)

    buckets: list[Bucket] = []
    for (dtype, device), members in groups.items():
        esize = _element_size(dtype)
        current: list[int] = []
        current_numel = 0
        for i in members:
            numel = payload_numel(tensors[i], symmetric)
            if numel == 0:
                continue
            if current and (current_numel + numel) * esize > cap_bytes:
                buckets.append(Bucket(tuple(current), current_numel, dtype, device))
                current, current_numel = [], 0
            current.append(i)
            current_numel += numel
        if current:
            buckets.append(Bucket(tuple(current), current_numel, dtype, device))
    return buckets


def _upper_mask(n: int, device: torch.device) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).triu()


def pack_symmetric(t: Tensor) -> Tensor:
    """Upper triangle (diagonal included) of ``t: [n, n]`` as ``[n (n + 1) / 2]``, row-major."""
    return t.detach()[_upper_mask(t.shape[0], t.device)]


def unpack_symmetric_(values: Tensor, out: Tensor) -> None:
    """Write the packed upper triangle ``values`` into ``out: [n, n]`` and mirror it.

    Args:
        values: ``[n (n + 1) / 2]`` elements, as produced by :func:`pack_symmetric`.
        out: ``[n, n]`` destination, overwritten in place (both triangles).
    """
    n = out.shape[0]
    full = torch.zeros(n, n, dtype=values.dtype, device=values.device)
    full[_upper_mask(n, values.device)] = values
    full += full.T.tril(-1)
    out.copy_(full)


def flatten_bucket(tensors: Sequence[Tensor], bucket: Bucket, symmetric: bool = False) -> Tensor:
    """Concatenate the bucket's tensors (or their upper triangles) into one 1-D buffer."""
    parts = [
        pack_symmetric(tensors[i]) if symmetric else tensors[i].detach().reshape(-1)
        for i in bucket.indices
    ]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def unflatten_bucket_(buffer: Tensor, tensors: Sequence[Tensor], bucket: Bucket, symmetric: bool = False) -> None:
    """Copy ``buffer`` (from :func:`flatten_bucket`) back into the bucket's tensors, in place."""
    offset = 0
    with torch.no_grad():
        for i in bucket.indices:
            t = tensors[i]
            numel = payload_numel(t, symmetric)
            chunk = buffer[offset:offset + numel]
            if symmetric:
                unpack_symmetric_(chunk, t)
            else:
                t.copy_(chunk.view(t.shape))
            offset += numel
    if offset != buffer.numel():
        raise RuntimeError(f"bucket buffer has {buffer.numel()} elements, tensors consumed {offset}")
