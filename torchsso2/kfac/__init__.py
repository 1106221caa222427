"""KAISA-interface K-FAC preconditioner, a drop-in for kfac_pytorch.

>>> from torchsso2.kfac import KFACPreconditioner
>>> preconditioner = KFACPreconditioner(model)
>>> loss.backward(); preconditioner.step(); optimizer.step()

kfac_pytorch's module layout is mirrored, so a script written for ``kfac`` runs after one
import line changes::

    import torchsso2.kfac as kfac        # kfac.preconditioner.KFACPreconditioner, kfac.enums, ...

or, leaving every ``import kfac`` / ``from kfac.x import y`` line as it is, run
``torchsso2.kfac.install_as_kfac()`` once before them (see :mod:`torchsso2.kfac.alias`).
See ``docs/kfac.md``.
"""
from . import base_preconditioner, enums, hyperparams, preconditioner, scheduler, warnings
from .alias import install_as_kfac
from .base_preconditioner import BaseKFACPreconditioner
from .enums import AllreduceMethod, AssignmentStrategy, ComputeMethod, DistributedStrategy, UnknownChoiceError
from .hyperparams import exp_decay_factor_averaging
from .preconditioner import KFACPreconditioner
from .scheduler import LambdaParamScheduler

# the submodules (kfac.preconditioner, kfac.enums, ...) are attributes but not in __all__, so that
# ``from torchsso2.kfac import *`` does not shadow the standard library's ``warnings``
__all__ = ["AllreduceMethod", "AssignmentStrategy", "BaseKFACPreconditioner", "ComputeMethod",
           "DistributedStrategy", "KFACPreconditioner", "LambdaParamScheduler", "UnknownChoiceError",
           "exp_decay_factor_averaging", "install_as_kfac"]
