"""Models whose parameters are sharded across processes (FSDP, ``DTensor``): refused with the fix.

The curvature blocks and the preconditioned step need, on every process, each covered layer's
whole parameters and whole gradients: a Kronecker factor pairs a layer's full input and output
dimensions, a diagonal or full block covers every element, and the KL clip and the non-finite
checks sum over all of them. FSDP (``FullyShardedDataParallel``, and ``fully_shard``, whose
parameters are ``DTensor`` shards) keeps one shard of each parameter per process, and tensor
parallelism holds ``DTensor`` parameters. On such a model a step failed inside torch ("got mixed
torch.Tensor and DTensor"), or, with ``use_orig_params=True``, saw the local shards as if they
were the layers. So the optimizers, ``KFACPreconditioner`` and ``curvature.compute`` refuse it
at construction and name the fix: data parallelism (``DistributedDataParallel``, or one process
per rank under ``mpiexec``; docs/distributed.md), which keeps whole parameters on every rank.

The check imports nothing: a model can only hold these types once their modules were imported,
so it looks them up in ``sys.modules``.
"""
from __future__ import annotations

import sys
from typing import List, Optional, Tuple

from torch import nn

#: (module of the class, class name, what it is): the FSDP wrappers of a module (``FSDPModule`` lived in
#: ``torch.distributed._composable.fsdp`` before torch 2.6)
_SHARDING_MODULES: Tuple[Tuple[str, str, str], ...] = (
    ("torch.distributed.fsdp", "FullyShardedDataParallel", "FullyShardedDataParallel"),
    ("torch.distributed.fsdp", "FSDPModule", "fully_shard (FSDP2)"),
    ("torch.distributed._composable.fsdp", "FSDPModule", "fully_shard (FSDP2)"),
)
#: where ``DTensor`` lives (``torch.distributed._tensor`` before torch 2.5)
_DTENSOR_MODULES = ("torch.distributed.tensor", "torch.distributed._tensor")


def _loaded_class(module_name: str, class_name: str) -> Optional[type]:
    """The class ``module_name.class_name`` when that module is imported already, else None."""
    mod = sys.modules.get(module_name)
    cls = getattr(mod, class_name, None) if mod is not None else None
    return cls if isinstance(cls, type) else None


def sharding_of(model: nn.Module) -> Optional[str]:
    """How ``model``'s parameters are sharded, in words (the first FSDP module found, a module FSDP
    manages from a wrapper around ``model``, or the ``DTensor`` parameters), or None for a model whose
    every parameter is a whole tensor."""
    wrappers = [(cls, what) for module_name, class_name, what in _SHARDING_MODULES
                if (cls := _loaded_class(module_name, class_name)) is not None]
    flat = _loaded_class("torch.distributed.fsdp._flat_param", "FlatParameter")
    for name, module in model.named_modules():
        what = next((w for cls, w in wrappers if isinstance(module, cls)), None)
        if what is not None:
            return f"module {name or '(the model)'!r} is wrapped by {what}"
        # the module itself given while its parent is the FSDP wrapper: torch marks every module it manages,
        # and FullyShardedDataParallel(use_orig_params=False) holds the local shard as one FlatParameter
        if getattr(module, "_is_fsdp_managed_module", False) is True:
            return (f"module {name or '(the model)'!r} is managed by FSDP (a FullyShardedDataParallel or fully_shard "
                    "wrapper of it or of a module around it)")
        if flat is not None and any(isinstance(p, flat) for p in module._parameters.values()):
            return f"module {name or '(the model)'!r} holds an FSDP FlatParameter (a flattened local shard)"
    dtensors = tuple({c for c in (_loaded_class(m, "DTensor") for m in _DTENSOR_MODULES) if c is not None})
    if dtensors:  # trainable ones: a frozen DTensor parameter takes no update and no curvature
        names: List[str] = [n for n, p in model.named_parameters() if p.requires_grad and isinstance(p, dtensors)]
        if names:
            shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
            return f"parameters {shown} are DTensors (sharded or tensor-parallel)"
    return None


def refuse_sharded(model: nn.Module, who: str) -> None:
    """ValueError when :func:`sharding_of` finds sharded parameters in ``model`` (``who``: the
    caller's name, for the message)."""
    how = sharding_of(model)
    if how is not None:
        raise ValueError(
            f"{who} cannot use a model whose parameters are sharded across processes: {how}. Its curvature needs "
            "every covered layer's whole parameters and gradients on each process. Train with data parallelism "
            "instead: wrap the model with torch.nn.parallel.DistributedDataParallel (or run one process per rank "
            "under mpiexec); see docs/distributed.md")


def sharded_since(how: str, who: str) -> str:
    """The reason (after "because") for a failure of ``who``'s step on a model sharded after ``who`` was built
    (``how``: :func:`sharding_of`'s words)."""
    return (f"the model is sharded across processes now ({how}), which {who} does not support: its curvature needs "
            "every covered layer's whole parameters and gradients on each process. Build it on a model trained with "
            "data parallelism (DistributedDataParallel, or one process per rank under mpiexec; docs/distributed.md)")
