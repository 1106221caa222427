"""Brute-force reference curvature, built only from ``torch.func`` / ``torch.autograd`` in float64.

Nothing here imports :mod:`curvature`. The reference works with the flat vector ``θ`` of the
*covered* parameters (parameters of Linear / Conv1d / Conv2d / Conv3d / ConvTranspose1d/2d/3d / BatchNorm1d/2d /
LayerNorm / GroupNorm / InstanceNorm1d/2d / RMSNorm / Embedding
modules that require grad, in ``model.named_parameters()`` order) and computes:

* ``J [N, O, P]``: per-example Jacobians of the flattened outputs w.r.t. ``θ`` (one ``jacrev``
  of the batch output; examples are independent in eval mode);
* an *output metric* ``M_n [O, O]`` per example and kind — ``fisher``: ``∂²ℓ_n/∂f_n²``
  (``torch.func.hessian`` of the per-example loss in the output), ``empirical_fisher``:
  ``∇ℓ_n ∇ℓ_nᵀ``, ``fisher_mc``: ``(1/S) Σ_s ∇ℓ(f_n, ỹ_sn) ∇ℓ(f_n, ỹ_sn)ᵀ`` for given labels;
* the curvature ``(1/N) Σ_n J_nᵀ M_n J_n``, or for ``hessian`` ``torch.func.hessian`` of the mean loss;
* block-diagonal (by module) and diagonal masks of those.

K-FAC factors are built independently of the module's parameter gradients: ``A`` from the
module inputs (Linear: the input; Conv1d/2d/3d: patches cut out by explicit slicing; ConvTranspose: each
output position's patch summed from the input elements that reach it, by the layer's definition; Embedding:
token counts) and ``G`` from the Jacobian of the outputs w.r.t. a zero *probe* added to the
module output by a forward hook, ``G = (1/N) Σ_{n,t} J_ntᵀ M_n J_nt``.
"""
from __future__ import annotations

import copy
import itertools
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d) + TRANSPOSED + (nn.BatchNorm1d, nn.BatchNorm3d, nn.InstanceNorm3d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm,
             nn.InstanceNorm1d, nn.InstanceNorm2d, nn.RMSNorm, nn.Embedding,
             nn.MultiheadAttention)  # its in_proj_weight / in_proj_bias
KFAC_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding) + TRANSPOSED


# ---- losses (per example) ------------------------------------------------------------------
def nll(loss: str, f: Tensor, y: Tensor) -> Tensor:
    """Per-example NLL of one output ``f [O]`` (cross_entropy: logits, y a class; mse: ½‖y − f‖²;
    binary_cross_entropy: ``Σ_o −y_o log σ(f_o) − (1 − y_o) log σ(−f_o)``, written out, not torch's loss)."""
    if loss == "cross_entropy":
        return -torch.log_softmax(f, dim=0)[y]
    if loss == "binary_cross_entropy":
        return -(y * torch.nn.functional.logsigmoid(f) + (1 - y) * torch.nn.functional.logsigmoid(-f)).sum()
    return 0.5 * ((y - f) ** 2).sum()


def elementwise(loss: str) -> bool:
    """Whether an example's target has the output's shape (mse, binary_cross_entropy), not one class index."""
    return loss != "cross_entropy"


def sample_labels(loss: str, outputs: Tensor, samples: int, seed: int) -> Tensor:
    """The labels the engine draws with ``torch.Generator().manual_seed(seed)``: ``[S, N(, O)]``."""
    gen = torch.Generator().manual_seed(seed)
    f = outputs.detach()
    if loss == "cross_entropy":  # inverse CDF: the first class whose cumulative probability exceeds u
        probs = torch.softmax(f.t(), dim=0).t() if f.shape[1] < 16 else torch.softmax(f, dim=1)
        u = torch.rand(f.shape[0], samples, generator=gen, dtype=torch.float64)
        return torch.searchsorted(probs.double().cumsum(1), u, right=True).clamp(max=f.shape[1] - 1).t()
    if loss == "binary_cross_entropy":  # label 1 where a float64 uniform (drawn example-major) falls below sigmoid(f)
        u = torch.rand(tuple(f.shape) + (samples,), generator=gen, dtype=torch.float64).movedim(-1, 0)
        return (u < torch.sigmoid(f).double()).to(f.dtype)
    return f.unsqueeze(0) + torch.randn((samples,) + tuple(f.shape), generator=gen, dtype=torch.float64).to(f.dtype)


# ---- covered parameters ------------------------------------------------------------------------
@dataclass
class ModuleSlice:
    name: str
    module: nn.Module
    start: int
    stop: int
    param_names: Tuple[str, ...]  # local names ("weight", "bias")


def covered(model: nn.Module, skip: Sequence[Union[str, type]] = ()) -> Tuple[List[str], List[ModuleSlice]]:
    """Covered parameter names (``named_parameters`` order) and the index range of each module."""
    modules = dict(model.named_modules())
    names: List[str] = []
    slices: List[ModuleSlice] = []
    offset = 0
    for full, p in model.named_parameters():
        if not p.requires_grad:
            continue
        mod_name, _, local = full.rpartition(".")
        mod = modules[mod_name]
        if not isinstance(mod, SUPPORTED):
            continue
        # a skipped module is skipped with its submodules: check it and every ancestor
        parts = mod_name.split(".") if mod_name else []
        lineage = [".".join(parts[:i]) for i in range(len(parts) + 1)]
        if any((isinstance(s, type) and isinstance(modules[a], s)) or (isinstance(s, str) and re.search(s, a) is not None)
               for s in skip for a in lineage):
            continue
        names.append(full)
        if slices and slices[-1].name == mod_name:
            s = slices[-1]
            s.stop += p.numel()
            s.param_names = s.param_names + (local,)
        else:
            slices.append(ModuleSlice(mod_name, mod, offset, offset + p.numel(), (local,)))
        offset += p.numel()
    return names, slices


def block_mask(slices: Sequence[ModuleSlice], p: int) -> Tensor:
    m = torch.zeros(p, p, dtype=torch.bool)
    for s in slices:
        m[s.start:s.stop, s.start:s.stop] = True
    return m


# ---- the reference --------------------------------------------------------------------------------
class Reference:
    """Dense reference curvatures of one model on one batch (float64)."""

    def __init__(self, model: nn.Module, inputs: Tensor, targets: Tensor, loss: str,
                 skip: Sequence[Union[str, type]] = ()) -> None:
        self.model, self.inputs, self.targets, self.loss = model, inputs, targets, loss
        self.names, self.slices = covered(model, skip)
        params = dict(model.named_parameters())
        self.shapes = [params[n].shape for n in self.names]
        self.theta = torch.cat([params[n].detach().reshape(-1) for n in self.names]).double()
        self.P = self.theta.numel()
        with torch.no_grad():
            self.outputs = model(inputs).double()
        self.N = self.outputs.shape[0]
        self.O = self.outputs[0].numel()
        self._J: Optional[Tensor] = None
        self._probe: Dict[str, Tensor] = {}
        self._dense: Dict[str, Tensor] = {}   # per kind (labels-free kinds only)
        self._metric: Dict[str, Tensor] = {}

    # -- functional forward --------------------------------------------------------------------
    def _unflatten(self, theta: Tensor) -> Dict[str, Tensor]:
        out, i = {}, 0
        for n, s in zip(self.names, self.shapes):
            k = math.prod(s)
            out[n] = theta[i:i + k].reshape(s)
            i += k
        return out

    def forward(self, theta: Tensor) -> Tensor:
        return functional_call(self.model, self._unflatten(theta), (self.inputs,))

    @property
    def J(self) -> Tensor:
        """``[N, O, P]`` per-example Jacobians of the flattened output."""
        if self._J is None:
            jac = jacrev(self.forward)(self.theta)  # [N, *out, P]
            self._J = jac.reshape(self.N, self.O, self.P)
        return self._J

    # -- output metrics M_n ---------------------------------------------------------------------
    def _loss_grad(self, f: Tensor, y: Tensor) -> Tensor:
        return torch.func.grad(lambda ff: nll(self.loss, ff, y))(f)

    def output_metric(self, kind: str, labels: Optional[Tensor] = None) -> Tensor:
        """``M [N, O, O]`` with curvature ``(1/N) Σ_n J_nᵀ M_n J_n`` (cached per kind and labels)."""
        if labels is not None:
            return self._output_metric(kind, labels)
        if kind not in self._metric:
            self._metric[kind] = self._output_metric(kind, labels)
        return self._metric[kind]

    def _output_metric(self, kind: str, labels: Optional[Tensor]) -> Tensor:
        f = self.outputs.reshape(self.N, self.O)
        ms = []
        for n in range(self.N):
            if kind == "fisher":
                y = self.targets[n].reshape(-1) if elementwise(self.loss) else self.targets[n]
                ms.append(hessian(lambda ff: nll(self.loss, ff, y))(f[n]))
            elif kind == "empirical_fisher":
                y = self.targets[n].reshape(-1) if elementwise(self.loss) else self.targets[n]
                g = self._loss_grad(f[n], y)
                ms.append(torch.outer(g, g))
            elif kind == "fisher_mc":
                assert labels is not None
                acc = torch.zeros(self.O, self.O, dtype=torch.float64)
                for s in range(labels.shape[0]):
                    y = labels[s, n].reshape(-1) if elementwise(self.loss) else labels[s, n]
                    g = self._loss_grad(f[n], y)
                    acc += torch.outer(g, g)
                ms.append(acc / labels.shape[0])
            else:
                raise ValueError(kind)
        return torch.stack(ms)

    # -- dense curvatures --------------------------------------------------------------------------
    def dense(self, kind: str, labels: Optional[Tensor] = None) -> Tensor:
        """The full ``[P, P]`` curvature of the mean loss (all cross-module entries included)."""
        if labels is not None:
            return self._dense_uncached(kind, labels)
        if kind not in self._dense:
            self._dense[kind] = self._dense_uncached(kind, labels)
        return self._dense[kind]

    def _dense_uncached(self, kind: str, labels: Optional[Tensor]) -> Tensor:
        if kind == "hessian":
            def mean_loss(theta: Tensor) -> Tensor:
                f = self.forward(theta).reshape(self.N, self.O)
                total = 0.0
                for n in range(self.N):
                    y = self.targets[n].reshape(-1) if elementwise(self.loss) else self.targets[n]
                    total = total + nll(self.loss, f[n], y)
                return total / self.N
            # reverse-over-reverse on purpose: torch.func.hessian (forward-over-reverse) is wrong
            # for F.embedding with padding_idx in torch 2.13 (its jvp ignores the padding row)
            return jacrev(jacrev(mean_loss))(self.theta)
        m = self.output_metric(kind, labels)
        return torch.einsum("nop,noq,nqr->pr", self.J, m, self.J) / self.N

    def block_diag(self, mat: Tensor) -> Tensor:
        return torch.where(block_mask(self.slices, self.P), mat, torch.zeros_like(mat))

    def shaped(self, kind: str, approx: Union[str, Dict[str, str]], labels: Optional[Tensor] = None) -> Tensor:
        """Block-diagonal reference in ``approx`` per module (a shape name or ``{module name: shape}``)."""
        full = self.dense(kind, labels)
        out = torch.zeros_like(full)
        for s in self.slices:
            shape = approx if isinstance(approx, str) else approx[s.name]
            if shape == "kfac" and not has_kfac(s.module):
                shape = "diag"  # the documented fallback for norm layers and grouped convolutions
            sl = slice(s.start, s.stop)
            if shape == "full":
                out[sl, sl] = full[sl, sl]
            elif shape == "diag":
                out[sl, sl] = torch.diag(torch.diagonal(full[sl, sl]))
            elif shape == "kfac":
                out[sl, sl] = self.kfac(s.name, kind, labels)[2]
            else:
                raise ValueError(shape)
        return out

    # -- K-FAC ----------------------------------------------------------------------------------------
    def _slice(self, name: str) -> ModuleSlice:
        return next(s for s in self.slices if s.name == name)

    def module_input(self, name: str) -> Tensor:
        """The module's input in this batch, recorded by a forward hook."""
        mod = self._slice(name).module
        rec: List[Tensor] = []
        h = mod.register_forward_hook(lambda m, i, o: rec.append(i[0].detach()))
        try:
            with torch.no_grad():
                self.model(self.inputs)
        finally:
            h.remove()
        return rec[0]

    def probe_jacobian(self, name: str) -> Tensor:
        """``[N, O, *module_output.shape[1:]]``: ∂f_n/∂z_n through a zero probe added to the output ``z``."""
        if name not in self._probe:
            mod = self._slice(name).module
            with torch.no_grad():
                shape = []
                h = mod.register_forward_hook(lambda m, i, o: shape.append(o.shape))
                self.model(self.inputs)
                h.remove()

            def f(probe: Tensor) -> Tensor:
                hk = mod.register_forward_hook(lambda m, i, o: o + probe)
                try:
                    return self.model(self.inputs).reshape(self.N, self.O)
                finally:
                    hk.remove()

            jac = jacrev(f)(torch.zeros(shape[0], dtype=torch.float64))  # [N, O, N, *out]
            idx = torch.arange(self.N)
            self._probe[name] = jac[idx, :, idx].detach()  # [N, O, *out] (the real params require grad)
        return self._probe[name]

    def kfac(self, name: str, kind: str, labels: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
        """``(A, G, dense)`` of module ``name``; ``dense`` in flat parameter order."""
        s = self._slice(name)
        mod = s.module
        x = self.module_input(name)
        jp = self.probe_jacobian(name)
        m = self.output_metric(kind, labels)
        has_bias = "bias" in s.param_names
        if isinstance(mod, nn.Embedding):
            tok = x.reshape(self.N, -1)
            t = tok.shape[1]
            jt = jp.reshape(self.N, self.O, t, -1)  # [N, O, T, D]
            counts = torch.zeros(mod.num_embeddings, dtype=torch.float64)
            d = mod.embedding_dim
            big_g = torch.zeros(d, d, dtype=torch.float64)
            for n in range(self.N):
                for tt in range(t):
                    if mod.padding_idx is not None and int(tok[n, tt]) == mod.padding_idx:
                        continue
                    counts[int(tok[n, tt])] += 1
                    big_g += jt[n, :, tt].t() @ m[n] @ jt[n, :, tt]
            big_a = counts / max(float(counts.sum()), 1.0)  # over the positions that reach the weight
            big_g = big_g / self.N
            return big_a, big_g, torch.kron(torch.diag(big_a), big_g)
        if isinstance(mod, nn.Linear):
            patches = x.reshape(self.N, -1, x.shape[-1])  # [N, T, d_in]: T = leading dims (1 for [N, d_in])
            jt = jp.reshape(self.N, self.O, patches.shape[1], -1)
        elif isinstance(mod, (nn.Conv1d, nn.Conv2d, nn.Conv3d) + TRANSPOSED):
            patches = conv_patches(x, mod) if isinstance(mod, nn.Conv2d) else conv1d_patches(x, mod) \
                if isinstance(mod, nn.Conv1d) else conv3d_patches(x, mod) if isinstance(mod, nn.Conv3d) \
                else transposed_patches(x, mod, jp.shape[3:])  # [N, T, C·k…]
            c_out = mod.out_channels
            jt = jp.reshape(self.N, self.O, c_out, -1).transpose(2, 3)  # [N, O, T, C_out]
        else:
            raise ValueError(f"no K-FAC for {type(mod).__name__}")
        t = patches.shape[1]
        has_weight = "weight" in s.param_names
        if not has_weight:  # frozen weight, trainable bias: the only input is the constant 1
            patches = patches[:, :, :0]
        if has_bias:
            patches = torch.cat([patches, torch.ones(patches.shape[:2] + (1,), dtype=patches.dtype)], dim=2)
        flat = patches.reshape(-1, patches.shape[-1])
        big_a = flat.t() @ flat / (self.N * t)
        d_out = jt.shape[-1]
        big_g = torch.zeros(d_out, d_out, dtype=torch.float64)
        for n in range(self.N):
            for tt in range(t):
                big_g += jt[n, :, tt].t() @ m[n] @ jt[n, :, tt]
        big_g = big_g / self.N
        # row-major vec([W.reshape(out, -1) | b]) -> flat parameter index; a transposed convolution's
        # M = [W' | b] with W'[o, i, κ] = W[i, o, k − 1 − κ] (curvature/modules/conv_transpose.py's convention)
        if isinstance(mod, TRANSPOSED):
            kdims = tuple(range(2, mod.weight.dim()))
            rows = mod.weight.shape[1]
            idx = torch.arange(mod.weight.numel()).reshape(mod.weight.shape).flip(kdims).transpose(0, 1)
            idx = idx.reshape(rows, -1) if has_weight else idx.new_zeros(rows, 0)
            cols = idx.shape[1]
        else:
            rows = mod.weight.shape[0]
            cols = mod.weight[0].numel() if has_weight else 0
            idx = torch.arange(rows * cols).reshape(rows, cols)
        if has_bias:
            idx = torch.cat([idx, (rows * cols + torch.arange(rows)).unsqueeze(1)], dim=1)
        idx = idx.reshape(-1)
        k = torch.kron(big_g, big_a)
        dense = torch.zeros_like(k)
        dense[idx.unsqueeze(1), idx.unsqueeze(0)] = k
        return big_a, big_g, dense


def conv_patches(x: Tensor, conv: nn.Conv2d) -> Tensor:
    """``[N, T, C·kh·kw]`` patches (channel-major) by explicit zero padding and slicing (no unfold)."""
    n, c, h, w = x.shape
    kh, kw = conv.kernel_size
    sh, sw = conv.stride
    ph, pw = conv.padding
    dh, dw = conv.dilation
    xp = torch.zeros(n, c, h + 2 * ph, w + 2 * pw, dtype=x.dtype)
    xp[:, :, ph:ph + h, pw:pw + w] = x
    h_out = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    w_out = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    cols = []
    for i in range(h_out):
        for j in range(w_out):
            patch = xp[:, :, i * sh: i * sh + dh * (kh - 1) + 1: dh, j * sw: j * sw + dw * (kw - 1) + 1: dw]
            assert patch.shape[2:] == (kh, kw)
            cols.append(patch.reshape(n, -1))
    return torch.stack(cols, dim=1)


def conv1d_patches(x: Tensor, conv: nn.Conv1d) -> Tensor:
    """``[N, T, C·k]`` patches (channel-major) of a Conv1d by explicit zero padding and slicing (no unfold)."""
    n, c, length = x.shape
    (k,), (s,), (d,) = conv.kernel_size, conv.stride, conv.dilation
    p = conv.padding[0] if not isinstance(conv.padding, str) else (0 if conv.padding == "valid" else d * (k - 1) // 2)
    xp = torch.zeros(n, c, length + 2 * p, dtype=x.dtype)
    xp[:, :, p:p + length] = x
    out = (length + 2 * p - d * (k - 1) - 1) // s + 1
    cols = [xp[:, :, i * s: i * s + d * (k - 1) + 1: d].reshape(n, -1) for i in range(out)]
    return torch.stack(cols, dim=1)


def conv3d_patches(x: Tensor, conv: nn.Conv3d) -> Tensor:
    """``[N, T, C·kd·kh·kw]`` patches (channel-major) of a Conv3d by explicit zero padding and slicing."""
    n, c = x.shape[:2]
    k, s, d, p = conv.kernel_size, conv.stride, conv.dilation, conv.padding
    xp = torch.zeros((n, c) + tuple(x.shape[2 + i] + 2 * p[i] for i in range(3)), dtype=x.dtype)
    xp[:, :, p[0]:p[0] + x.shape[2], p[1]:p[1] + x.shape[3], p[2]:p[2] + x.shape[4]] = x
    out = [(xp.shape[2 + i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(3)]
    cols = []
    for a in range(out[0]):
        for b in range(out[1]):
            for e in range(out[2]):
                patch = xp[:, :, a * s[0]: a * s[0] + d[0] * (k[0] - 1) + 1: d[0],
                           b * s[1]: b * s[1] + d[1] * (k[1] - 1) + 1: d[1],
                           e * s[2]: e * s[2] + d[2] * (k[2] - 1) + 1: d[2]]
                cols.append(patch.reshape(n, -1))
    return torch.stack(cols, dim=1)


def has_kfac(module: nn.Module) -> bool:
    """Whether K-FAC is defined for ``module``: its type has it, and a convolution is not grouped."""
    return isinstance(module, KFAC_TYPES) and getattr(module, "groups", 1) == 1


def transposed_patches(x: Tensor, conv: nn.Module, out_size: Sequence[int]) -> Tensor:
    """``[N, T, C_in·∏k]`` patches of a ConvTranspose1d/2d/3d with output positions ``out_size``, from the
    layer's definition ``y[o, t] = Σ_{i, κ, q: s·q − p + d·κ = t} W[i, o, κ] x[i, q]``: feature ``(i, κ')`` of
    position ``t`` is ``x[i, q]`` for ``κ = k − 1 − κ'`` (the flipped kernel of the matrix ``W'``) where some
    input position ``q`` reaches ``t`` through ``κ``, else 0. Loops over positions and kernel offsets."""
    n, c = x.shape[:2]
    k, s, d, p = conv.kernel_size, conv.stride, conv.dilation, conv.padding
    kernel = list(itertools.product(*[range(ki) for ki in k]))
    out = torch.zeros((n, math.prod(out_size), c, len(kernel)), dtype=x.dtype)
    for t_idx, t in enumerate(itertools.product(*[range(o) for o in out_size])):
        for j, kappa_flipped in enumerate(kernel):
            kappa = [ki - 1 - kf for ki, kf in zip(k, kappa_flipped)]
            q = []
            for ti, si, pi, di, ka, size in zip(t, s, p, d, kappa, x.shape[2:]):
                num = ti + pi - di * ka
                if num % si or not 0 <= num // si < size:
                    break
                q.append(num // si)
            else:
                out[:, t_idx, :, j] = x[(slice(None), slice(None)) + tuple(q)]
    return out.reshape(n, out.shape[1], -1)


def freeze_batchnorm(model: nn.Module, inputs: Tensor) -> nn.Module:
    """A copy of a train-mode ``model`` in eval mode whose BatchNorm layers use this batch's statistics.

    The statistics (mean, biased variance over the batch and spatial dims) are measured by a
    training-mode forward of another copy; in the returned model they are constants.
    """
    probe = copy.deepcopy(model).train()
    stats: Dict[str, Tuple[Tensor, Tensor]] = {}
    hooks = []
    for name, m in probe.named_modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
            def hook(mod: nn.Module, inp: Tuple[Tensor, ...], out: Tensor, name: str = name) -> None:
                x = inp[0].detach()
                dims = [0] + list(range(2, x.dim()))
                stats[name] = (x.mean(dim=dims), x.var(dim=dims, unbiased=False))
            hooks.append(m.register_forward_hook(hook))
    with torch.no_grad():
        probe(inputs)
    for h in hooks:
        h.remove()
    frozen = copy.deepcopy(model).eval()
    for name, m in frozen.named_modules():
        if name in stats:
            with torch.no_grad():
                m.running_mean.copy_(stats[name][0])
                m.running_var.copy_(stats[name][1])
    return frozen
