"""The enums of the kfac_pytorch interface, under the same names and values.

``AssignmentStrategy`` and ``DistributedStrategy`` are the ones of
:mod:`torchsso2.distributed` (same members and values as kfac_pytorch's); ``ComputeMethod``
and ``AllreduceMethod`` are defined here. Wherever kfac_pytorch takes one of these enums,
:func:`parse_choice` also accepts

* a case-insensitive member name (``"eigen"``, ``"compute"``, ...), as kfac_pytorch does;
* a member of kfac_pytorch's enum of the same name (``kfac.enums.ComputeMethod.EIGEN``),
  mapped by name and value to ours.

An unknown name raises :class:`UnknownChoiceError`, which is both a ``KeyError`` (what
kfac_pytorch raises) and a ``ValueError`` (what a bad value raises elsewhere here).
"""
from __future__ import annotations

from enum import Enum
from typing import Type, TypeVar, Union

from curvature.options import a_or_an, did_you_mean
from torchsso2.distributed import AssignmentStrategy, DistributedStrategy, parse_enum

__all__ = ["AllreduceMethod", "AssignmentStrategy", "ComputeMethod", "DistributedStrategy",
           "UnknownChoiceError", "parse_choice", "parse_enum"]

E = TypeVar("E", bound=Enum)


class AllreduceMethod(Enum):
    """How the factors are all-reduced: one collective per factor or bucketed.

    ``KFACPreconditioner.allreduce_method`` is ``ALLREDUCE_BUCKETED`` when
    ``allreduce_bucket_cap_mb > 0`` and ``ALLREDUCE`` when it is ``0`` (kfac_pytorch's rule).
    """

    ALLREDUCE = 1
    ALLREDUCE_BUCKETED = 2


class ComputeMethod(Enum):
    """How the damped factors are used to precondition a gradient.

    * ``EIGEN``: eigendecompositions ``A = Q_A Λ_A Q_Aᵀ``, ``G = Q_G Λ_G Q_Gᵀ``;
      ``P = Q_G [(Q_Gᵀ ∇W Q_A) ⊘ (λ_G λ_Aᵀ + damping)] Q_Aᵀ``.
    * ``INVERSE``: damped inverses; ``P = (G + damping·I)⁻¹ ∇W (A + damping·I)⁻¹``.
    """

    EIGEN = 1
    INVERSE = 2


class UnknownChoiceError(KeyError, ValueError):
    """An unknown enum member name: both a ``KeyError`` (kfac_pytorch) and a ``ValueError``."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


def parse_choice(value: Union[E, Enum, str], enum: Type[E], arg: str) -> E:
    """``value`` as a member of ``enum``.

    Accepts a member of ``enum``, a member of another library's enum with the same class
    name (kfac_pytorch's ``kfac.enums``) whose member name and value exist in ``enum``, or a
    case-insensitive member name.

    Raises:
        UnknownChoiceError: unknown name (a ``KeyError`` and a ``ValueError``; the message
            names the value and the choices).
        TypeError: anything else (the message names the value and what was expected).
    """
    if isinstance(value, enum):
        return value
    choices = ", ".join(m.name for m in enum)
    if isinstance(value, Enum) and type(value).__name__ == enum.__name__:
        member = enum.__members__.get(value.name)
        if member is not None and member.value == value.value:
            return member
        raise TypeError(f"{arg}={value!r} has no counterpart in {enum.__module__}.{enum.__name__} "
                        f"(members {choices})")
    if isinstance(value, str):
        member = enum.__members__.get(value.strip().upper())
        if member is None:
            hint = did_you_mean(value, [m.name.lower() for m in enum])
            raise UnknownChoiceError(f"{arg}={value!r} is not valid{hint}; expected one of {choices} "
                                     f"({a_or_an(enum.__name__)} {enum.__name__} or its name)")
        return member
    raise TypeError(f"{arg} must be {a_or_an(enum.__name__)} {enum.__name__} or a string, got {type(value).__name__} "
                    f"{value!r}")
