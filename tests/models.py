"""Tiny test models (a few hundred parameters at most) and their batches.

Every model maps its input to ``[N, 3]`` outputs (logits for cross-entropy, means for mse, three labels' logits
for binary_cross_entropy).
:data:`MODELS` maps a name to a ``(build, batch)`` pair: ``build()`` returns a float64
model in eval mode (seeded), ``batch(n, loss)`` returns ``(inputs, targets)``.
"""
from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

OUT = 3


class MLP(nn.Module):
    """Linear → nn.ReLU → Linear → functional tanh → Linear (bias everywhere)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 6)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(6, 4)
        self.fc3 = nn.Linear(4, OUT)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc3(torch.tanh(self.fc2(self.act(self.fc1(x)))))


class CNN(nn.Module):
    """Conv2d (padding, bias) → ReLU → Conv2d (stride 2, dilation 2, padding, no bias) → max-pool → flatten → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 2, kernel_size=3, padding=1)                      # [2, 5, 5]
        self.conv2 = nn.Conv2d(2, 3, kernel_size=2, stride=2, dilation=2, padding=1, bias=False)  # [3, 3, 3]
        self.pool = nn.MaxPool2d(2, stride=1)                                       # [3, 2, 2]
        self.fc = nn.Linear(12, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = self.pool(self.conv2(F.relu(self.conv1(x))))
        return self.fc(torch.flatten(h, 1))


class CNN1d(nn.Module):
    """Conv1d (padding, bias) → ReLU → Conv1d ('same', dilation 2, no bias) → tanh → Conv1d (stride 2) →
    flatten → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(2, 3, kernel_size=3, padding=1)                             # [3, 6]
        self.conv2 = nn.Conv1d(3, 2, kernel_size=3, dilation=2, padding="same", bias=False)  # [2, 6]
        self.conv3 = nn.Conv1d(2, 2, kernel_size=2, stride=2)                               # [2, 3]
        self.fc = nn.Linear(6, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv3(torch.tanh(self.conv2(F.relu(self.conv1(x)))))
        return self.fc(torch.flatten(h, 1))


class GroupRMSNorm(nn.Module):
    """Conv2d → GroupNorm (2 groups of 2 channels) → tanh → InstanceNorm2d (affine) → flatten → Linear →
    RMSNorm → Linear: the normalizations that use each example's own statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, kernel_size=2)  # [4, 2, 2]
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.fc = nn.Linear(16, 5)
        self.rms = nn.RMSNorm(5, eps=1e-6)
        self.out = nn.Linear(5, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inorm(torch.tanh(self.gn(self.conv(x)))).flatten(1)
        return self.out(self.rms(self.fc(h)))


class CNN3d(nn.Module):
    """Conv3d (padding, bias) → ReLU → Conv3d (stride 2, dilation (1, 2, 1), no bias) → flatten → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(2, 2, kernel_size=(2, 3, 2), padding=(0, 1, 1))                      # [2, 2, 4, 5]
        self.conv2 = nn.Conv3d(2, 2, kernel_size=(1, 2, 2), stride=2, dilation=(1, 2, 1), bias=False)  # [2, 1, 1, 2]
        self.fc = nn.Linear(4, OUT)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(torch.flatten(self.conv2(F.relu(self.conv1(x))), 1))


class ConvT(nn.Module):
    """ConvTranspose2d (stride 2, padding 1, called with ``output_size``: one more row and column than its
    ``output_padding`` 0 gives) → tanh → ConvTranspose2d (stride (1, 2), dilation 2, padding 3 > d(k − 1): the
    zero-inserted input is cropped; no bias) → flatten → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up1 = nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1)                                   # [2, 6, 6]
        self.up2 = nn.ConvTranspose2d(2, 2, 2, stride=(1, 2), dilation=2, padding=3, bias=False)      # [2, 2, 7]
        self.fc = nn.Linear(28, OUT)

    def forward(self, x: Tensor) -> Tensor:  # [N, 2, 3, 3]
        h = torch.tanh(self.up1(x, output_size=(6, 6)))
        return self.fc(torch.flatten(self.up2(h), 1))


class ConvT13(nn.Module):
    """ConvTranspose1d (stride 2, padding 1, output_padding 1) → ReLU → as ``[N, C, 1, 2, 3]`` → ConvTranspose3d
    (stride (1, 2, 1), padding (0, 1, 0)) → flatten → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.up1 = nn.ConvTranspose1d(2, 3, 3, stride=2, padding=1, output_padding=1)              # [3, 6]
        self.up3 = nn.ConvTranspose3d(3, 2, (1, 2, 2), stride=(1, 2, 1), padding=(0, 1, 0))           # [2, 1, 2, 4]
        self.fc = nn.Linear(16, OUT)

    def forward(self, x: Tensor) -> Tensor:  # [N, 2, 3]
        h = F.relu(self.up1(x)).reshape(x.shape[0], 3, 1, 2, 3)
        return self.fc(torch.flatten(self.up3(h), 1))


class NormMLP(nn.Module):
    """Linear → BatchNorm1d → tanh → LayerNorm → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 5)
        self.bn = nn.BatchNorm1d(5)
        self.ln = nn.LayerNorm(5)
        self.fc2 = nn.Linear(5, OUT)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.ln(torch.tanh(self.bn(self.fc1(x)))))


class NormCNN(nn.Module):
    """Conv2d → BatchNorm2d → ReLU → LayerNorm over [C, H, W] (multi-dim normalized_shape) → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 2, kernel_size=2)   # [2, 2, 2]
        self.bn = nn.BatchNorm2d(2)
        self.ln = nn.LayerNorm([2, 2, 2])
        self.fc = nn.Linear(8, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(F.relu(self.bn(self.conv(x))))
        return self.fc(h.flatten(1))


class Grouped(nn.Module):
    """Depthwise Conv2d (groups 4, padding) → tanh → Conv2d (groups 2, stride 2) → as [N, 6, 4] → Conv1d (groups 3,
    no bias) → flatten → Linear. K-FAC is not defined for grouped convolutions: a K-FAC request gives them the
    diagonal."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv2d(4, 4, 3, padding=1, groups=4)        # [4, 4, 4]
        self.gc = nn.Conv2d(4, 6, 2, stride=2, groups=2)          # [6, 2, 2]
        self.g1 = nn.Conv1d(6, 3, 2, groups=3, bias=False)        # [3, 3]
        self.fc = nn.Linear(9, OUT)

    def forward(self, x: Tensor) -> Tensor:  # [N, 4, 4, 4]
        h = self.gc(torch.tanh(self.dw(x))).flatten(2)
        return self.fc(torch.flatten(self.g1(h), 1))


class Norm3d(nn.Module):
    """Conv3d → BatchNorm3d → ReLU → InstanceNorm3d (affine) → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, kernel_size=(1, 2, 2))   # [2, 2, 2, 2]
        self.bn = nn.BatchNorm3d(2)
        self.inorm = nn.InstanceNorm3d(2, affine=True)
        self.fc = nn.Linear(16, OUT)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.inorm(F.relu(self.bn(self.conv(x)))).flatten(1))


class ResBNCNN(nn.Module):
    """A residual block with BatchNorm: conv1 → BN → ReLU → conv2 (padding 1) + conv1's output
    (skip) → BN → Linear. Upstream of each BatchNorm the gradient takes the skip path too."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 2, kernel_size=2)   # [2, 2, 2]
        self.bn1 = nn.BatchNorm2d(2)
        self.conv2 = nn.Conv2d(2, 2, kernel_size=3, padding=1)
        self.bn2 = nn.BatchNorm2d(2)
        self.fc = nn.Linear(8, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(x)
        r = self.conv2(F.relu(self.bn1(h))) + h
        return self.fc(self.bn2(r).flatten(1))


class EmbeddingModel(nn.Module):
    """Embedding (padding_idx=0) of tokens ``[N, T]`` → mean over T → Linear."""

    VOCAB = 7

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(self.VOCAB, 4, padding_idx=0)
        self.fc = nn.Linear(4, OUT)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.fc(self.emb(tokens).mean(dim=1))


class SeqLinear(nn.Module):
    """Linear applied to a sequence ``[N, T, d]`` (T weight-sharing positions) → tanh → mean over T → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Linear(3, 4)
        self.head = nn.Linear(4, OUT, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.tok(x)).mean(dim=1))


class Residual(nn.Module):
    """Linear → x + tanh(Linear(x)) → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)
        self.out = nn.Linear(4, OUT)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = h + torch.tanh(self.inner(h))
        return self.out(h)


class InplaceDropout(nn.Module):
    """Linear → nn.ReLU(inplace=True) → Dropout (eval mode) → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 6)
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(6, OUT)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.drop(self.relu(self.fc1(x))))


class Experts(nn.Module):
    """A gate (``nn.Linear(4, 3)``) picks one of three expert ``nn.Linear(4, 3)`` per row (a mixture of experts);
    the output is the gate's logits × 0.1 plus each row's expert output. ``call_empty``: the experts no row was
    routed to are called too, on no rows (counted in ``empty_calls``). Seeded; not in :data:`MODELS`."""

    def __init__(self, call_empty: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate = nn.Linear(4, 3)
        self.experts = nn.ModuleList(nn.Linear(4, 3) for _ in range(3))
        self.call_empty = call_empty
        self.empty_calls = 0

    def forward(self, x: Tensor) -> Tensor:
        gates = self.gate(x)
        pick = gates.argmax(1)
        out = gates * 0.1
        for k, expert in enumerate(self.experts):
            rows = (pick == k).nonzero().squeeze(1)
            if rows.numel() or self.call_empty:
                self.empty_calls += rows.numel() == 0
                out = out.index_add(0, rows, expert(x[rows]))
        return out


def _randomize_norm_stats(model: nn.Module) -> nn.Module:
    """Non-trivial running statistics and affine parameters, so eval-mode BN is not the identity."""
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm, nn.InstanceNorm2d,
                          nn.InstanceNorm3d, nn.RMSNorm)):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.5, 0.5)
    return model


def _targets(n: int, loss: str, gen: torch.Generator) -> Tensor:
    if loss == "cross_entropy":
        return torch.randint(0, OUT, (n,), generator=gen)
    if loss == "binary_cross_entropy":  # 0/1 labels, one soft label
        y = torch.randint(0, 2, (n, OUT), generator=gen).double()
        y[0, 0] = 0.25
        return y
    return torch.randn(n, OUT, generator=gen, dtype=torch.float64)


def _dense_batch(*shape: int) -> Callable[[int, str], Tuple[Tensor, Tensor]]:
    def batch(n: int, loss: str, seed: int = 0) -> Tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(1000 + seed)
        x = torch.randn((n,) + shape, generator=gen, dtype=torch.float64)
        return x, _targets(n, loss, gen)
    return batch


def _token_batch(t: int) -> Callable[[int, str], Tuple[Tensor, Tensor]]:
    def batch(n: int, loss: str, seed: int = 0) -> Tuple[Tensor, Tensor]:
        gen = torch.Generator().manual_seed(2000 + seed)
        x = torch.randint(0, EmbeddingModel.VOCAB, (n, t), generator=gen)
        x[0, 0] = 0  # at least one padding token
        return x, _targets(n, loss, gen)
    return batch


def _builder(cls: type) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        torch.manual_seed(0)
        return _randomize_norm_stats(cls()).double().eval()
    return build


MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[..., Tuple[Tensor, Tensor]]]] = {
    "mlp": (_builder(MLP), _dense_batch(5)),
    "cnn": (_builder(CNN), _dense_batch(2, 5, 5)),
    "cnn1d": (_builder(CNN1d), _dense_batch(2, 6)),
    "cnn3d": (_builder(CNN3d), _dense_batch(2, 3, 4, 4)),
    "convt": (_builder(ConvT), _dense_batch(2, 3, 3)),
    "convt13": (_builder(ConvT13), _dense_batch(2, 3)),
    "norm_mlp": (_builder(NormMLP), _dense_batch(4)),
    "norm_cnn": (_builder(NormCNN), _dense_batch(2, 3, 3)),
    "norm3d": (_builder(Norm3d), _dense_batch(2, 2, 3, 3)),
    "grouped": (_builder(Grouped), _dense_batch(4, 4, 4)),
    "group_rms_norm": (_builder(GroupRMSNorm), _dense_batch(2, 3, 3)),
    "embedding": (_builder(EmbeddingModel), _token_batch(3)),
    "residual": (_builder(Residual), _dense_batch(4)),
    "seq_linear": (_builder(SeqLinear), _dense_batch(2, 3)),
    "inplace_dropout": (_builder(InplaceDropout), _dense_batch(4)),
}
