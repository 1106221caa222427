"""Per-layer-family math. Adding a layer = adding one small file and one registry entry."""
from __future__ import annotations

from typing import Optional, Tuple

from torch import nn

from .attention import MultiheadAttentionFamily
from .base import LayerFamily
from .conv import Conv1dFamily, Conv2dFamily, Conv3dFamily
from .conv_transpose import ConvTransposeFamily
from .embedding import EmbeddingFamily
from .linear import LinearFamily
from .norm import BatchNormFamily, GroupNormFamily, InstanceNormFamily, LayerNormFamily, RMSNormFamily

FAMILIES: Tuple[LayerFamily, ...] = (
    LinearFamily(), Conv2dFamily(), Conv1dFamily(), Conv3dFamily(), ConvTransposeFamily(), BatchNormFamily(),
    LayerNormFamily(), GroupNormFamily(), InstanceNormFamily(), RMSNormFamily(), EmbeddingFamily(),
    MultiheadAttentionFamily(),
)

#: the covered layer types, as error messages name them
SUPPORTED_LAYERS = ("Linear, Conv1d/2d/3d, ConvTranspose1d/2d/3d, BatchNorm1d/2d/3d, LayerNorm, GroupNorm, "
                    "InstanceNorm1d/2d/3d, RMSNorm, Embedding, MultiheadAttention")


def family_of(module: nn.Module) -> Optional[LayerFamily]:
    """The family whose layer types ``module`` is an instance of, or None (a subclass replacing
    ``forward`` is refused by :func:`curvature.selection.forward_replaced`)."""
    for fam in FAMILIES:
        if isinstance(module, fam.module_types):
            return fam
    return None


__all__ = ["LayerFamily", "FAMILIES", "SUPPORTED_LAYERS", "family_of"]
