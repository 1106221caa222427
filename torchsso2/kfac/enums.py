"""The enums of the kfac_pytorch interface, under the same names and values.

``AssignmentStrategy`` and ``DistributedStrategy`` are the ones of
:mod:`torchsso2.distributed` (same members and values as kfac_pytorch's); ``ComputeMethod``
is defined here. Strings are accepted wherever kfac_pytorch accepts them (case-insensitive
member names: ``"eigen"``, ``"compute"``, ...).
"""
from __future__ import annotations

from enum import Enum
from typing import Type, TypeVar, Union

from torchsso2.distributed import AssignmentStrategy, DistributedStrategy

__all__ = ["AssignmentStrategy", "ComputeMethod", "DistributedStrategy", "parse_enum"]


class ComputeMethod(Enum):
    """How the damped factors are used to precondition a gradient.

    * ``EIGEN``: eigendecompositions ``A = Q_A Λ_A Q_Aᵀ``, ``G = Q_G Λ_G Q_Gᵀ``;
      ``P = Q_G [(Q_Gᵀ ∇W Q_A) ⊘ (λ_G λ_Aᵀ + damping)] Q_Aᵀ``.
    * ``INVERSE``: damped inverses; ``P = (G + damping·I)⁻¹ ∇W (A + damping·I)⁻¹``.
    """

    EIGEN = 1
    INVERSE = 2


E = TypeVar("E", bound=Enum)


def parse_enum(value: Union[E, str], enum: Type[E], arg: str) -> E:
    """``value`` as a member of ``enum``; a string is a case-insensitive member name.

    Raises:
        ValueError: unknown name (the message names the value and the choices).
        TypeError: neither a member nor a string.
    """
    if isinstance(value, enum):
        return value
    choices = ", ".join(m.name for m in enum)
    if isinstance(value, str):
        try:
            return enum[value.strip().upper()]
        except KeyError:
            raise ValueError(f"{arg}={value!r} is not valid; expected one of {choices} "
                             f"(an {enum.__name__} or its name)") from None
    raise TypeError(f"{arg} must be an {enum.__name__} or a string, got {type(value).__name__} {value!r}")
