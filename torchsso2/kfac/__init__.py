"""KAISA-interface K-FAC preconditioner, a drop-in for kfac_pytorch.

>>> from torchsso2.kfac import KFACPreconditioner
>>> preconditioner = KFACPreconditioner(model)
>>> loss.backward(); preconditioner.step(); optimizer.step()

See ``docs/kfac.md``.
"""
from .enums import AssignmentStrategy, ComputeMethod, DistributedStrategy
from .preconditioner import KFACPreconditioner

__all__ = ["AssignmentStrategy", "ComputeMethod", "DistributedStrategy", "KFACPreconditioner"]
