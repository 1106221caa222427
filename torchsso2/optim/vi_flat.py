"""VIOptimizer's ``curvature="reparam"`` step on flat buffers: the same step, with one op per stage.

The general step (:meth:`VIOptimizer.step`) works block by block and parameter by parameter and
rebuilds its per-block views every step. On a small model that bookkeeping, not the arithmetic,
is most of a VI step (digits MLP 64-128-10 at batch 64: the update took longer than the model's
forward and backward). When every trainable parameter is in a diagonal block of one dtype and
one device, one process draws its one weight sample and no grad scaler is used, the whole
posterior state is a few vectors over all ``P`` covered parameters, and this module keeps it so:

* ``C`` (the running curvature): the blocks' ``diagonal`` tensors are views of it;
* ``D = N·C + τδ + damping`` (the decomposition): the blocks' ``decomposition["denom"]`` are views
  of it, and ``1/D``, ``1/√D`` are kept beside it;
* ``m`` (the momentum): ``state[p]["momentum_buffer"]`` are views of it;
* a second buffer of ``D``: the next decomposition is written there, checked, and the two swap
  roles (no copy, and a decomposition that fails its check leaves the current one untouched);
* three workspaces: one holds the draw ``z``, then the noise ``ε`` (in place), then the step; one
  the flat gradient ``g``, then ``ĥ = g ⊙ ε ⊙ D/τ``, then the EMA's ``ĥ − C``; one the EMA's
  other temporaries (so the flat state costs ``4·P`` numbers beyond what the blocks keep anyway).

A step is then: one seeded ``randn`` into ``z``; the closure at ``μ + z ⊙ √τ/√D`` (one
``torch._foreach_addcmul``); ``g`` by one ``torch._foreach_copy_``; ``ε = z ⊙ √τ/√D`` in place;
``ĥ`` in two ops; the finite check of ``g`` and ``ĥ`` in one kernel; IVON's EMA of ``C``; ``D``,
its check and reciprocals on the flat vector; the momentum in one fused SGD kernel; the
(KL-clipped) mean's step in one ``foreach`` op. The flat ops write into the buffers above (no
allocation), the hyper-parameters enter as cached 0-dim tensors (rebuilt when a value changes;
a Python scalar is wrapped into a tensor at every call), and the sample's weights are swapped in
and out inline: on a small model (digits MLP, batch 64, 1 thread) this per-op overhead, not the
arithmetic, is what a VI step costs beyond Adam's.

The numbers are those of the general step: the same elementwise operations in the same order
(IVON's EMA is :func:`~torchsso2.optim.reparam.reparam_ema_`'s four ops, written out here to use
the workspaces); the KL clip's ``Σ uᵀm`` is one dot product instead of one sum per parameter, so
its rounding differs in the last bits. tests/test_vi_flat.py compares the two paths bit for bit.

Everything the general step handles and this one does not falls back to it, checked at every
step before anything is drawn: the first step (isotropic noise, no decomposition yet), several
MC samples or processes, a grad scaler, curvature or decomposition skipped by their intervals,
parameters not covered, frozen or of mixed dtypes, param groups with different ``lr`` or
``momentum`` or momentum 0, and state replaced from outside (``load_state_dict``, a swapped
parameter, ``model.double()``): the flat buffers are relinked to the new state at the next
step that qualifies. After the closure, a parameter without a gradient hands the step to the
general code; a non-finite loss, gradient or ``ĥ`` skips the step with the state untouched; a
decomposition that is not positive and finite hands the rest of the step to the general code
(its message and policy).
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from curvature.blocks import DiagBlock
from curvature.blocks.base import DerivedCache, all_finite

from .grid import noise_seed
from .plan import params_with_grad
from .steps import kl_clip_scale, kl_sum_float64
from .vi_start import debias_factor
from .validation import as_loss_tensor

__all__ = ["FlatDiagPath"]

_FLOAT_DTYPES = (torch.float32, torch.float64)


class _Link:
    """The flat buffers and the state objects they back (checked by identity at every step)."""

    def __init__(self, opt: Any, names: List[str], blocks: List[DiagBlock], params: List[nn.Parameter],
                 group_params: Tuple[nn.Parameter, ...]) -> None:
        self.names = names
        self.blocks = blocks
        self.params = params
        self.group_params = group_params
        self.layouts = [opt.engine.layouts[n] for n in names]
        first = params[0]
        self.dtype, self.device = first.dtype, first.device
        self.numel = sum(p.numel() for p in params)
        with torch.no_grad():
            self.curv = torch.cat([b.diagonal.reshape(-1) for b in blocks])
            self.denom = torch.cat([b.decomposition["denom"].reshape(-1) for b in blocks])
            state = opt.state
            self.momentum = torch.cat([state[p]["momentum_buffer"].reshape(-1) for p in params])
        self.inv = self.denom.reciprocal()      # as DiagBlock's cached 1/denom and 1/√denom
        self.inv_sqrt = self.inv.sqrt()
        # the next decomposition is written into ``spare`` and the two swap roles once it is checked
        # (no copy; the old one stays intact when the check fails); ``work`` holds the EMA's temporaries
        self.spare = torch.empty_like(self.denom)
        self.work = torch.empty_like(self.curv)
        #: the step's hyper-parameters as 0-dim tensors (see :meth:`scalars`)
        self._scalar_key: Optional[Tuple[float, ...]] = None
        self._scalar_values: Tuple[Tensor, ...] = ()
        # workspaces: z, then ε = z·√τ/√D in place, then the step N·m/D; and the gradient, then ĥ
        self.noise = torch.empty_like(self.curv)
        self.hat = torch.empty_like(self.curv)
        offset = 0
        self.decompositions: List[Dict[str, Tensor]] = []
        #: each block's slice of the two decomposition buffers: ``denom_views[k][b]`` (k = 0: ``denom``, 1: ``spare``)
        self.denom_views: Tuple[List[Tensor], List[Tensor]] = ([], [])
        self.diagonals: List[Tensor] = []
        self.momentum_views: List[Tensor] = []
        self.noise_views: List[Tensor] = []
        self.inv_views: List[Tensor] = []
        self.inv_sqrt_views: List[Tensor] = []
        self.hat_views: List[Tensor] = []
        for blk, lay in zip(blocks, self.layouts):
            n = lay.numel
            blk.diagonal = self.curv.narrow(0, offset, n)
            blk.decomposition = {"denom": self.denom.narrow(0, offset, n)}
            # its cache held the general path's 1/denom and 1/√denom (and their source) alive: three
            # parameter-sized tensors for the optimizer's life; rebuilt if the general path runs again
            blk._reciprocal_cache = DerivedCache()
            self.denom_views[0].append(blk.decomposition["denom"])
            self.denom_views[1].append(self.spare.narrow(0, offset, n))
            self.diagonals.append(blk.diagonal)
            self.decompositions.append(blk.decomposition)
            for views, flat in ((self.momentum_views, self.momentum), (self.noise_views, self.noise),
                                (self.inv_views, self.inv), (self.inv_sqrt_views, self.inv_sqrt),
                                (self.hat_views, self.hat)):
                views.extend(lay.unflatten(flat.narrow(0, offset, n)))
            offset += n
        for p, view in zip(params, self.momentum_views):
            state[p]["momentum_buffer"] = view
        #: what :meth:`intact` compares by identity at every step
        self.block_checks = list(zip(names, blocks, self.diagonals, self.decompositions))
        owners = [(lay.module._parameters, pname) for lay in self.layouts for pname in lay.param_names]
        self.param_checks = [(own, pname, p, view) for (own, pname), p, view
                             in zip(owners, params, self.momentum_views)]
        self.device_key = str(self.device)

    def scalars(self, n: float, shift: float, decay: float) -> Tuple[Tensor, ...]:
        """``(N, τδ + damping, (τδ + damping)/N, 1 − β)`` as 0-dim tensors of the buffers' dtype, rebuilt
        only when a value changes: an op with a Python scalar wraps it into a tensor at every call
        (~1 µs each on CPU); the results are the same (the scalar is cast to the tensor's dtype either way)."""
        key = (n, shift, decay)
        if key != self._scalar_key:
            self._scalar_values = tuple(torch.tensor(v, dtype=self.dtype, device=self.device)
                                        for v in (n, shift, shift / n, 1.0 - decay))
            self._scalar_key = key
        return self._scalar_values

    def swap_decomposition(self) -> None:
        """Make ``spare`` (just written and checked) the decomposition the blocks hold, and the old one
        the next step's ``spare``."""
        self.denom, self.spare = self.spare, self.denom
        views = self.denom_views[1]
        self.denom_views = (views, self.denom_views[0])
        for dec, view in zip(self.decompositions, views):
            dec["denom"] = view

    def intact(self, opt: Any) -> bool:
        """The optimizer's state is still the one these buffers back (nothing replaced from outside)."""
        running = opt.running.blocks
        for name, blk, diag, dec in self.block_checks:
            if running.get(name) is not blk or blk.diagonal is not diag or blk.decomposition is not dec:
                return False
        state = opt.state
        dtype, device = self.dtype, self.device
        for own, pname, p, view in self.param_checks:
            if own.get(pname) is not p or not p.requires_grad or p.dtype != dtype or p.device != device \
                    or state[p].get("momentum_buffer") is not view or not p.is_contiguous():
                return False
        mine = self.group_params
        i = 0
        for group in opt.param_groups:
            for p in group["params"]:
                if i >= len(mine) or p is not mine[i]:
                    return False
                i += 1
        return i == len(mine)


class FlatDiagPath:
    """The flat-buffer step of :class:`VIOptimizer` with ``curvature="reparam"`` (see the module
    docstring); :meth:`step` returns None where the general step must run."""

    def __init__(self) -> None:
        self._link: Optional[_Link] = None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FlatDiagPath":
        # a copied optimizer relinks its own (copied) state at its next step
        return FlatDiagPath()

    # ---- eligibility -------------------------------------------------------------------------
    @staticmethod
    def _hyper(opt: Any) -> Optional[Tuple[float, float]]:
        """``(lr, momentum)`` when every param group has the same, momentum > 0; else None."""
        groups = opt.param_groups
        lr, mom = groups[0]["lr"], groups[0]["momentum"]
        for g in groups:
            if g["lr"] != lr or g["momentum"] != mom:
                return None
        return (float(lr), float(mom)) if mom != 0 else None

    @staticmethod
    def _step_qualifies(opt: Any) -> bool:
        """This step samples once, in one process, estimates and decomposes, without a grad scaler, a
        learned noise variance or an Embedding padding row."""
        t = opt.num_steps
        return (opt._decomposed and opt.num_mc_samples == 1 and opt.comm.world_size == 1
                and opt.grad_scaler is None and not opt.placement.active
                and not opt.noise.learned  # the general step collects the residuals that learn σ²
                and not opt._padding_rows  # the general step leaves Embedding padding rows unsampled
                and t % opt.curv_update_interval == 0 and t % opt.inv_update_interval == 0)

    def _current(self, opt: Any) -> Optional[_Link]:
        """The link to the optimizer's state, relinked when something was replaced; None when the
        state does not fit flat buffers (the general step runs)."""
        link = self._link
        if link is not None and link.intact(opt):
            for blk in link.blocks:  # a predict() / sampled_params() between steps filled it (see _Link)
                if blk._reciprocal_cache._value is not None:
                    blk._reciprocal_cache = DerivedCache()
            return link
        self._link = link = self._build(opt)
        return link

    @staticmethod
    def _build(opt: Any) -> Optional[_Link]:
        blocks = opt.running.blocks
        layouts = opt.engine.layouts
        if not blocks or set(blocks) != set(layouts):
            return None
        names = list(layouts)
        params: List[nn.Parameter] = []
        chosen: List[DiagBlock] = []
        for name in names:
            blk = blocks[name]
            if type(blk) is not DiagBlock or blk.decomposition is None or "denom" not in blk.decomposition:
                return None
            chosen.append(blk)
            params.extend(layouts[name].params)
        group_params = tuple(p for g in opt.param_groups for p in g["params"])
        if not params or len(group_params) != len(params) or {id(p) for p in group_params} != {id(p) for p in params}:
            return None  # parameters outside the blocks (skip_modules), or tied/duplicated ones
        dtype, device = params[0].dtype, params[0].device
        if dtype not in _FLOAT_DTYPES or opt._noise_dtype != dtype or opt._noise_device != device \
                or opt.decomposition_dtype not in (None, dtype):
            return None
        state = opt.state
        for p in params:
            buf = state[p].get("momentum_buffer") if p in state else None
            if not p.requires_grad or p.dtype != dtype or p.device != device or buf is None \
                    or buf.dtype != dtype or buf.device != device or buf.shape != p.shape \
                    or not p.is_contiguous():  # the fused kernels pair the flat views by memory position
                return None
        for blk in chosen:
            for t in (blk.diagonal, blk.decomposition["denom"]):
                if t.dtype != dtype or t.device != device or t.dim() != 1:
                    return None
        return _Link(opt, names, chosen, params, group_params)

    # ---- the step ----------------------------------------------------------------------------
    def step(self, opt: Any, closure: Any, targets: Optional[Tensor]) -> Optional[Tuple[Tensor, Any]]:
        """One VI step of ``opt`` on the flat buffers; None (nothing done) where the general step must run."""
        if not self._step_qualifies(opt):
            return None
        hyper = self._hyper(opt)
        if hyper is None:
            return None
        link = self._current(opt)
        if link is None:
            return None
        lr, mom = hyper
        if opt.momentum_debias:  # the lr of step t = num_steps + 1, as VIOptimizer._update_mean
            lr = lr * debias_factor(mom, opt.num_steps + 1)
        n = float(opt.likelihood_size)  # N/σ² (N unless noise_variance is given or learned)
        tau = opt.kl_weighting
        # what a skipped step gives back: the norm layers' statistics (the sampling generator is not
        # drawn from here: the noise has its own seeded stream and no labels are sampled)
        snapshot = opt._undo.save(None)
        sample = opt.grid.samples(opt.comm.rank, 1)[0]
        gen = opt._noise_streams.seeded(noise_seed(opt.seed, opt.num_steps, sample), link.device_key)
        z = torch.randn(link.numel, generator=gen, out=link.noise)
        if tau != 1.0:
            z.mul_(opt._noise_scale)
        params = link.params
        # the closure at μ + z·√τ/√D (as shifted_params(params, ε, factors) of _coloured_all, inline:
        # this runs at every step): the parameters point at the sampled tensors, then at their own again
        means = [p.data for p in params]
        try:
            for p, w in zip(params, torch._foreach_addcmul(means, link.noise_views, link.inv_sqrt_views)):
                p.data = w
            loss, output, _ = opt._run_closure(closure, targets, False)
        except BaseException:  # a closure that raised (Ctrl-C, a bad batch): the norm layers' statistics back,
            snapshot.restore()  # so training on is as if the call never happened
            raise
        finally:
            for p, m in zip(params, means):
                p.data = m
        mean_loss = loss.detach() if isinstance(loss, Tensor) else as_loss_tensor(loss)
        grads = [p.grad for p in params]
        for g in grads:
            if g is None or g.dtype != link.dtype or g.layout is not torch.strided:
                # a parameter without a gradient (or an unusual one): the general step takes over
                hats = opt._reparam_sample((params, link.noise_views, link.inv_sqrt_views))
                return opt._finish_step(snapshot, [mean_loss], output, hats, None)
        shift = opt.precision_shift
        decay = opt.ema_decay
        n_t, shift_t, shift_n_t, rate0_t = link.scalars(n, shift, decay)
        with torch.no_grad():
            torch._foreach_copy_(link.hat_views, grads)
            eps = z.mul_(link.inv_sqrt)  # ε = z·√τ/√D, the sample's shift
            hat = link.hat.mul_(eps)  # ĥ = g ⊙ ε ⊙ D/τ (reparam_diagonal's order)
            hat.mul_(link.denom if tau == 1.0 else link.denom / tau)
            # ĥ is not finite wherever g is not (ε and D are finite): one sum checks both, with the
            # loss; only a non-finite total (a bad element, or finite ones overflowing) is looked at
            # element by element
            total = float(hat.sum()) + (float(mean_loss) if mean_loss.numel() == 1 else math.inf)
            if not math.isfinite(total) and (not all_finite([mean_loss]) or not bool(torch.isfinite(hat).all())):
                fresh = {name: DiagBlock(lay, hat.narrow(0, *opt._noise_spans[name]))  # the blocks' (offset, numel)
                         for name, lay in zip(link.names, link.layouts)}
                opt._nonfinite("loss, gradient or curvature", snapshot, opt._what_is_nonfinite(mean_loss, fresh))
                return mean_loss, output
            # reparam_ema_(C, ĥ, β, shift/N): its four ops, with ĥ's buffer and ``work`` as the temporaries
            curv = link.curv
            x = torch.add(curv, shift_n_t, out=link.work)  # C + shift
            diff = hat.sub_(curv)  # ĥ − C
            rate = torch.addcdiv(rate0_t, diff, x, value=0.5 * (1.0 - decay) ** 2, out=link.work)
            new = torch.addcmul(curv, diff, rate, out=link.noise)  # the new C, kept once its denominator is checked
            denom = torch.mul(new, n_t, out=link.spare).add_(shift_t)  # DiagBlock.decompose: scale·C + damping
            low, high = torch.aminmax(denom)
            if not float(high) < math.inf:  # a huge finite gradient overflowed the update: a non-finite step, as
                # one with an infinite gradient (the running curvature would stay unusable from here on)
                opt._nonfinite("curvature (its update overflowed)", snapshot,
                               lambda: f"the curvature update reached {float(high)} (largest |gradient| "
                                       f"{max(float(g.abs().max()) for g in grads)})")
                return mean_loss, output
            curv.copy_(new)
            opt.running.num_updates += 1
            if not float(low) > 0.0:  # check_positive's failure: its message, its policy
                opt._decompose(shift, scale=n)
                ps, groups = params_with_grad(opt.param_groups)
                opt._update_mean(ps, groups, [p.grad for p in ps])
                opt._step_taken()
                opt.num_steps += 1
                return mean_loss, output
            link.swap_decomposition()  # the blocks' decomposition is now ``denom``
            torch.reciprocal(denom, out=link.inv)
            torch.sqrt(link.inv, out=link.inv_sqrt)
            # m ← mom·m + (g + τδ/N·μ): natural_momentum_'s fused kernel
            torch._fused_sgd_(params, grads, link.momentum_views, weight_decay=tau * opt.prior_precision / n,
                              momentum=mom, lr=0.0, dampening=0.0, nesterov=False, maximize=False,
                              is_first_step=False)
            if opt.kl_clip is None:  # preconditioned_descent_'s fused update
                torch._foreach_addcmul_(params, link.momentum_views, link.inv_views, value=-lr * n)
            else:  # u = N·m/D; ν = min(1, √(kl_clip / (lr²·uᵀm)))
                step = torch.mul(link.momentum, link.inv, out=link.noise).mul_(n_t)
                vg = lr * lr * float(torch.dot(step, link.momentum))
                if not math.isfinite(vg):  # overflowing the working precision
                    vg = kl_sum_float64([step], [link.momentum], [lr])
                nu = kl_clip_scale(vg, opt.kl_clip)
                torch._foreach_add_(params, link.noise_views, alpha=-(lr * nu))
        opt._step_taken()
        opt.num_steps += 1
        return mean_loss, output
