"""kfac_pytorch's test model (two Linear layers, the first without bias), shared by the drop-in's
compatibility tests and their distributed worker."""
from __future__ import annotations

import torch
from torch import nn


class Tiny(nn.Module):
    """Two Linear layers (the first without bias), as in kfac_pytorch's tests."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(10, 20, bias=False)
        self.linear2 = nn.Linear(20, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.linear2(torch.relu(self.linear1(x))), dim=1)
