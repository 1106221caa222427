"""The enums of the kfac_pytorch interface, under the same names and values.

``AssignmentStrategy`` and ``DistributedStrategy`` are the ones of
:mod:`torchsso2.distributed` (same members and values as kfac_pytorch's); ``ComputeMethod``
is defined here. Strings are accepted wherever kfac_pytorch accepts them (case-insensitive
member names: ``"eigen"``, ``"compute"``, ...).
"""
from __future__ import annotations

from enum import Enum
from torchsso2.distributed import AssignmentStrategy, DistributedStrategy, parse_enum

__all__ = ["AssignmentStrategy", "ComputeMethod", "DistributedStrategy", "parse_enum"]


class ComputeMethod(Enum):
    """How the damped factors are used to precondition a gradient.

    * ``EIGEN``: eigendecompositions ``A = Q_A Λ_A Q_Aᵀ``, ``G = Q_G Λ_G Q_Gᵀ``;
      ``P = Q_G [(Q_Gᵀ ∇W Q_A) ⊘ (λ_G λ_Aᵀ + damping)] Q_Aᵀ``.
    * ``INVERSE``: damped inverses; ``P = (G + damping·I)⁻¹ ∇W (A + damping·I)⁻¹``.
    """

    EIGEN = 1
    INVERSE = 2
