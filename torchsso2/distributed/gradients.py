"""``average_gradients``: the gradients' mean over the ranks, as ``DistributedDataParallel`` takes it.

For a plain model under ``mpiexec`` (no DDP), before ``KFACPreconditioner.step()``. Averaging only
the gradients that exist on a rank (``[p.grad for p in model.parameters() if p.grad is not None]``)
goes wrong as soon as the ranks' batches reach different parameters (a head, an expert, a LayerDrop
block one rank's batch skipped): the ranks then reduce lists of other lengths, which pairs one
parameter's gradient with another's or leaves the buffers of different sizes.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from torchsso2.distributed.communicator import Communicator
from torchsso2.distributed.consistency import sizes_row

__all__ = ["average_gradients"]


def average_gradients(parameters: Iterable[nn.Parameter], comm: Communicator) -> None:
    """Average the ``.grad`` of ``parameters`` over the ranks of ``comm``, in place.

    Every parameter that requires grad takes part (the same list, in the same order, on every rank), with
    zeros where this rank has no gradient, as ``DistributedDataParallel(find_unused_parameters=True)`` does;
    one flag per parameter rides first in the same all-reduce, so a parameter no rank has a gradient for
    keeps ``grad=None``. One process: nothing to do.

    The count and total size of the parameters are compared first, in an all-reduce of three numbers:
    ranks that disagree on which parameters train (``requires_grad_`` changed on some ranks only, all of
    them frozen on one) would pair one parameter's gradient with another's (MPI reduces that without an
    error) or wait in different collectives.

    Args:
        parameters: the model's parameters (``model.parameters()``).
        comm: the communicator (``preconditioner.tdc``, or :func:`~torchsso2.distributed.get_communicator`).

    Raises:
        TypeError: a sparse gradient (an ``nn.Embedding(sparse=True)``): densify it or use DDP.
        RuntimeError: the ranks hold other numbers or sizes of parameters that require grad (the
            gradients are then not usable).
    """
    params = [p for p in parameters if p.requires_grad]
    if comm.world_size == 1:
        return
    sparse = [tuple(p.shape) for p in params if p.grad is not None and p.grad.is_sparse]
    if sparse:
        raise TypeError(f"average_gradients: sparse gradients (parameters of shapes {sparse}) cannot be averaged "
                        "in the flat buckets; use nn.Embedding(sparse=False) or DistributedDataParallel")
    # the count and size first, in a collective of their own (three float64 numbers, exact modulo 2^30 / W): ranks
    # with other lists would reduce buffers of other sizes, or other numbers of buckets, in the gradients' one
    exact = max(1, 2 ** 30 // comm.world_size)
    numel = sum(p.numel() for p in params)
    mine = sizes_row(len(params), numel, exact)
    device = params[0].device if params else \
        (torch.device("cuda", torch.cuda.current_device()) if getattr(comm, "backend_name", "") == "nccl"
         else torch.device("cpu"))
    sizes = torch.tensor(mine, dtype=torch.float64, device=device)
    comm.allreduce([sizes], op="mean")
    if sizes.tolist() != mine:
        raise RuntimeError(
            f"average_gradients: rank {comm.rank} averages gradients of {len(params)} parameters that require grad "
            f"({numel} numbers), but the ranks hold other numbers or sizes: the ranks disagree on which parameters "
            "train (requires_grad changed on some ranks only); change them on every rank alike. The gradients of "
            "this step are not usable")
    if not params:
        return
    lacking = [p.grad is None for p in params]
    grads = [torch.zeros_like(p) if none else p.grad for p, none in zip(params, lacking)]
    real = grads[0].real.dtype if grads[0].is_complex() else grads[0].dtype
    flag = torch.tensor([0.0 if none else 1.0 for none in lacking], dtype=real, device=grads[0].device)
    comm.allreduce([flag] + grads, op="mean")
    for p, g, none, share in zip(params, grads, lacking, flag.tolist()):
        if none and share > 0:  # another rank's batch reached it: this rank's zeros, averaged
            p.grad = g
