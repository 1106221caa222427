"""Checks that turn silent misuse of the optimizers into a clear error or warning.

* :func:`check_model_argument`: ``SecondOrderOptimizer(model.parameters())`` instead of the model.
* :func:`check_option`: an unknown ``curvature=``/``loss=`` string, with the closest valid names.
* :class:`ClosureWatch`: around one closure call of ``step``:

  - the closure never called ``backward()`` (no parameter's ``.grad`` was created or changed):
    ``RuntimeError`` — the parameters would never move;
  - ``loss="cross_entropy"`` but the closure's loss is not a function of ``softmax(output)``
    (e.g. an MSE loss on the logits): ``UserWarning``, once per optimizer. The test is exact
    and cheap: any loss of ``softmax(z)`` is invariant to adding a constant to every logit of a
    row, so the rows of its gradient ``∂loss/∂z`` (``[N, C]``, read by a tensor hook during the
    user's own backward) sum to zero; the warning fires when
    ``Σ_n |Σ_c g_nc| > 1e-2 · Σ_nc |g_nc|``. Outputs that are already log-probabilities
    (``logsumexp`` of every row 0, as with ``nll_loss(log_softmax(z))``) are not checked: their
    gradient does not sum to zero although the categorical likelihood is the right one.
    It runs on the first :data:`OUTPUT_CHECKS` curvature-estimating steps only; steps without a
    curvature estimate check their output only while no estimating step has checked one (an
    optimizer that never estimates with its closure, e.g. ``VIOptimizer``'s ``curvature="reparam"``,
    is checked on its first plain steps; a K-FAC optimizer's plain steps between estimates cost
    nothing: ~0.16 ms each for the digits CNN at batch 128).

  - ``loss="cross_entropy"`` and no ``grad_scaler``, but the output gradient is more than
    :data:`SCALE_LIMIT` times a mean cross-entropy's bound (``Σ_rows max_c |∂L/∂z| ≤ 1``, class weights,
    masks and ``ignore_index`` included): ``UserWarning``, once (a
    GradScaler the optimizer was not given, a summed loss over many rows).

  - ``loss="cross_entropy"`` and a curvature that counts every row of the output as an example (the Fisher
    kinds, the empirical Fisher; not ``VIOptimizer``'s default diagonal, which reads the loss's gradient), but
    some rows get no gradient from the closure's loss (``ignore_index`` padding, a mask): ``UserWarning``,
    once, at a curvature-estimating call, naming the ``output_selector`` that takes the valid rows.

  They watch the first :data:`CLOSURE_CHECKS` closure calls of an optimizer (a misused closure
  is misused from its first call); later calls cost nothing (~13 µs per watched call for four
  parameters).
* :func:`eval_mode`: a model put into ``eval()`` for a prediction and then given back its own
  ``training`` flags (``VIOptimizer.predict``).
"""
from __future__ import annotations

import contextlib
import warnings
from enum import Enum
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type, TypeVar

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from curvature.blocks.kfac import KFACBlock
from curvature.hook_marks import in_func_transform
from curvature.options import parse
from curvature.stacklevel import caller_stacklevel

E = TypeVar("E", bound=Enum)

#: how many closure calls per optimizer are watched at all (then the watch costs nothing)
CLOSURE_CHECKS = 5
#: the error for a closure that computed no gradient (checked at the first calls, and wherever a step needs one)
NO_BACKWARD = ("the closure did not call backward() (no parameter's .grad was created or changed), or it "
               "cleared the gradients after it (zero_grad() after loss.backward()), so the parameters would never "
               "move. The closure must call opt.zero_grad(), compute the loss, call "
               "loss.backward() and return the loss (or (loss, output)), with the model the optimizer was built "
               "with (opt.model: copy.deepcopy(opt) alone copies the model too; copy both together, "
               "copy.deepcopy((model, opt))). Two optimizers cannot share one backward: each step's closure runs "
               "its own forward and backward (the curvature is captured in that forward)")
#: how many curvature-estimating closure calls (among those) check the loss against ``loss=``
OUTPUT_CHECKS = 3
#: relative row-sum of the output gradient above which the loss is not a function of softmax(output)
SHIFT_TOLERANCE = 1e-2
#: a mean cross-entropy's gradient with respect to the logits, ``w_n (p_n − y_n) / Σ w`` per row (weights 1,
#: or 0 for rows it leaves out: a mask, ``ignore_index``), has ``Σ_rows max_c |g| ≤ 1``; this many times more is
#: a scaled loss (a GradScaler the optimizer was not given, ``reduction="sum"`` over many rows)
SCALE_LIMIT = 64.0


def check_model_argument(model: Any, face: str, skip_argument: str = "skip_modules") -> None:
    """TypeError unless ``model`` is an ``nn.Module``; says "pass the model itself" for an iterable of
    parameters (``model.parameters()``) or parameter groups. ValueError for parameters on the meta device."""
    if isinstance(model, nn.Module):
        meta = [n for n, p in model.named_parameters() if p.is_meta]
        if meta:  # to_empty() / load_state_dict(assign=True) replace them: the optimizer would hold dead ones
            raise ValueError(f"{face}: parameters {meta[:5]}{' ...' if len(meta) > 5 else ''} are on the meta device "
                             "(no data yet); materialize the model first (model.to_empty(device=...) and initialize "
                             "it, or load_state_dict(..., assign=True)), then build the optimizer: those calls "
                             "replace the parameters, and an optimizer built before would hold the old ones")
        return
    if isinstance(model, (Iterator, list, tuple)) or hasattr(model, "__next__"):
        raise TypeError(f"{face} takes the model (a torch.nn.Module), not its parameters: pass the model itself "
                        f"({face}(model, ...)); got {type(model).__name__}. To train only some parameters, "
                        f"set requires_grad=False on the others or use {skip_argument}=[...]")
    raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def check_option(enum_type: Type[E], value: object, what: str) -> E:
    """``parse(enum_type, value, what)``: a ValueError names ``what`` and suggests close valid values."""
    return parse(enum_type, value, what)


def _grad_state(params: List[Tensor]) -> List[Tuple[Optional[Tensor], int]]:
    return [(p.grad, p.grad._version if p.grad is not None else -1) for p in params]


class ClosureWatch:
    """Watches one closure call; see the module docstring. ``checks_left`` is shared per optimizer
    through :attr:`owner` (a ``dict`` the optimizer keeps)."""

    def __init__(self, param_groups: List[dict], categorical: Optional[str], owner: dict,
                 estimating: bool = True, check_scale: bool = False, keep_output_grads: bool = False,
                 rows_counted: Optional[str] = None) -> None:
        """``categorical``: what uses the categorical likelihood of ``loss='cross_entropy'`` (a sentence for
        the warning), or None when nothing does (another loss, or a curvature from the user's own
        gradients alone): the output is then not checked for it. ``check_scale``: the loss is a cross-entropy
        whose gradient the optimizer takes unscaled (no ``grad_scaler``): the output gradient's size is
        checked against a mean's (:data:`SCALE_LIMIT`). ``keep_output_grads``: each observed output and the
        gradient the user's backward gave it are left in ``owner["output_grads"]`` (VIOptimizer's loss-scale
        check, :mod:`torchsso2.optim.vi_checks`). ``rows_counted``: how this call's curvature counts every row
        of the output (a clause for the warning about rows the closure's loss leaves out), or None when it
        takes the rows from the loss's own gradient."""
        left = owner.get("closure_checks_left", CLOSURE_CHECKS)
        self.active = left > 0
        self.params: List[Tensor] = []
        self.handles: List[Any] = []
        self.check_output = False
        self.check_scale = False
        self.sizes: List[Tensor] = []  # Σ_rows max_c |∂L/∂output| per observed output
        self.keep_output_grads = False
        self.output_grads: List[Tuple[Tensor, Tensor]] = []  # (output, ∂L/∂output) per observed output
        self.stats: List[Tuple[Tensor, Tensor, Optional[Tensor]]] = []
        #: the first observed output (in its graph), for :mod:`.output_consumers`
        self.first_output: Optional[Tensor] = None
        self.rows_counted: Optional[str] = None
        #: per observed output: [rows with a nonzero ∂L/∂output in some backward (None before the first), rows
        #: whose prediction is not saturated (a saturated softmax has p − y = 0 in a row the loss does use)]
        self.row_grads: List[List[Optional[Tensor]]] = []
        if not self.active:  # checked enough closure calls: no cost from here on
            return
        owner["closure_checks_left"] = left - 1
        self.params = [p for g in param_groups for p in g["params"] if p.requires_grad]
        self.before = _grad_state(self.params)
        # gradients left from before (zero_grad(set_to_none=False), or none at all): an in-place
        # zero_() and an accumulation both bump the version, so watch the accumulation itself
        self.accumulated = False
        self.handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in self.params] \
            if any(g is not None for g, _ in self.before) else []
        self.owner = owner
        self.estimating = estimating
        self.categorical = categorical
        self.check_output = categorical is not None and owner.get("output_checks_left", OUTPUT_CHECKS) > 0 \
            and (estimating or not owner.get("estimating_output_checked", False))
        self.check_scale = check_scale and not owner.get("scale_warned", False)
        self.keep_output_grads = keep_output_grads
        self.rows_counted = rows_counted if estimating and not owner.get("ignored_rows_warned", False) else None

    @staticmethod
    def watching(owner: dict) -> bool:
        """Whether the optimizer owning ``owner`` still watches its closure calls (a watch built now
        would be active); after :data:`CLOSURE_CHECKS` calls a step can skip building one."""
        return owner.get("closure_checks_left", CLOSURE_CHECKS) > 0

    def observe_output(self, out: Tensor, raw: Any = None, selector: Optional[Callable[[Any], Any]] = None) -> None:
        """Hook the gradient of one forward's (selected) output ``out`` (``[N, C]`` or ``[N, ..., C]``).

        ``raw``, ``selector``: the model's own output and the ``output_selector`` that made ``out`` of it. A
        selector that builds a new tensor (``o.reshape(-1, C)``, ``o["logits"].movedim(1, -1)``) gives one the
        closure's loss does not go through (it reshapes the output itself): the gradient then reaches the
        model's output tensors only, and the checks take ``selector`` of that gradient (the gradient with
        respect to ``out`` for a selection or a view of the output) as it arrives; only where ``out`` is a view
        of one of the model's output tensors (the selector is called on a structure holding the gradient in that
        tensor's place, the other tensors as shape-only placeholders)."""
        if not isinstance(out, Tensor) or not out.requires_grad or in_func_transform():
            return
        if self.active and self.first_output is None:
            self.first_output = out
        uses: List[Callable[[Tensor], None]] = []
        if self.keep_output_grads:
            seen = out.detach()
            uses.append(lambda g: self.output_grads.append((seen, g.detach())))
        classes = out.dim() >= 2 and out.shape[-1] >= 2 and out.is_floating_point() and out.numel() > 0
        lse = z = None
        if classes and (self.check_output or self.check_scale or self.rows_counted is not None):
            with torch.no_grad():  # one logsumexp over the classes serves both checks below
                z = out.detach().float()
                lse = torch.logsumexp(z, -1)
        if lse is not None and (self.check_output or self.check_scale):
            # log-probabilities: nll_loss(log_softmax(z)) is the categorical likelihood too
            if not bool(lse.abs().max() < 1e-3):
                if self.check_scale:  # Σ over the rows of each row's largest |∂L/∂z| (classes last)
                    uses.append(lambda g: self.sizes.append(g.detach().abs().amax(-1).sum()))
                if self.check_output:
                    uses.append(self._record)
        if lse is not None and self.rows_counted is not None:  # rows the loss leaves out (ignore_index, a mask): an
            with torch.no_grad():  # all-zero gradient row; each row's largest probability, exp(max z − logsumexp z)
                top = (z.amax(-1) - lse).exp()  # type: ignore[union-attr]
                entry: List[Optional[Tensor]] = [None, top < 1.0 - SATURATED]
            self.row_grads.append(entry)

            def reached(g: Tensor, entry: List[Optional[Tensor]] = entry) -> None:  # OR over the backward passes
                hit = (g.detach() != 0).any(-1)
                entry[0] = hit if entry[0] is None else entry[0] | hit
            uses.append(reached)
        if not uses:
            return
        seen_grad: List[bool] = []

        def take(g: Tensor) -> None:
            seen_grad.append(True)
            for use in uses:
                use(g)
        out.register_hook(take)
        if raw is None or selector is None or raw is out:
            return
        leaves, spec = tree_flatten(raw)
        if any(leaf is out for leaf in leaves):  # the selector picked one of the output tensors: hooked above
            return
        storage = out.untyped_storage().data_ptr()
        # the output tensor ``out`` is a view of (computed by the model: a Parameter it returns keeps its hooks)
        base = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor) and leaf is not out
                and leaf.grad_fn is not None and leaf.untyped_storage().data_ptr() == storage]
        if not base:
            return  # not a view of the model's output (o.log_softmax(-1), o * 3): its gradient is no selection
        hooked = leaves[base[0]]
        # every place of the output holding that tensor takes its gradient; the other entries are placeholders of
        # their shapes (on the meta device: no memory kept, no reference back to the hooked tensor)
        same = [leaf is hooked for leaf in leaves]
        rest = [torch.empty_like(leaf, device="meta") if isinstance(leaf, Tensor) else leaf for leaf in leaves]
        shape = out.shape

        def through(g: Tensor) -> None:
            if seen_grad:  # the loss went through ``out`` (its gradient comes first): taken there
                return
            try:
                with torch.no_grad():
                    picked = selector(tree_unflatten([g if here else r for r, here in zip(rest, same)], spec))
            except Exception:  # a selector that is not a selection (it reads the model, a method of its output)
                return
            # (a placeholder picked: the selector reads another output tensor than the one ``out`` is a view of)
            if isinstance(picked, Tensor) and picked.shape == shape and not picked.is_meta:
                take(picked)
        hooked.register_hook(through)

    def _record(self, g: Tensor) -> None:
        g = g.detach().float()
        # with more than two dims, also the sums over dim 1: F.cross_entropy's own layout [N, C, ...]
        # (classes at dim 1) gives rows summing to zero there, not over the last dim
        self.stats.append((g.sum(-1).abs().sum(), g.abs().sum(), g.sum(1).abs().sum() if g.dim() > 2 else None))

    def _check_scale(self) -> None:
        """Warn (once per optimizer) when the output gradient is :data:`SCALE_LIMIT` times a mean cross-entropy's."""
        if not self.check_scale or not self.sizes:
            return
        ratio = max(float(s) for s in self.sizes)
        if ratio > SCALE_LIMIT:
            self.owner["scale_warned"] = True
            warnings.warn(SCALED_LOSS.format(ratio=ratio), UserWarning, stacklevel=caller_stacklevel())

    def _check_ignored_rows(self) -> None:
        """Warn (once per optimizer) when some, not all, rows of the output got no gradient from the loss while
        the curvature counts every row (``rows_counted``)."""
        # the outputs the loss reads (one it does not, or only times 0, is not a padded batch: other checks' business)
        reached = [(hit, live) for hit, live in self.row_grads if hit is not None and bool(hit.any())]
        if self.rows_counted is None or not reached:
            return
        zero = int(sum(int((~hit & live).sum()) for hit, live in reached))  # type: ignore[operator]
        total = sum(hit.numel() for hit, _ in reached)
        if zero:
            self.owner["ignored_rows_warned"] = True
            warnings.warn(IGNORED_ROWS.format(zero=zero, total=total, what=self.rows_counted), UserWarning,
                          stacklevel=caller_stacklevel())

    def _accumulated(self, _: Tensor) -> None:
        self.accumulated = True

    def __enter__(self) -> "ClosureWatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()
        if exc[0] is not None:  # the closure raised: nothing reads the output now
            self.give_back()

    @contextlib.contextmanager
    def finishing(self) -> Iterator[None]:
        """The checks after the closure: where one raises, the call is given back (:meth:`give_back`); else
        the output is released (:meth:`release`)."""
        try:
            yield
        except BaseException:
            self.give_back()
            raise
        self.release()

    def give_back(self) -> None:
        """A call that did not finish (the closure, or a check after it, raised): the output is released and
        the call is not counted as a watched one (a step that does not finish leaves the optimizer as it was)."""
        self.release()
        if self.active:
            self.active = False  # given back once
            self.owner["closure_checks_left"] = self.owner.get("closure_checks_left", 0) + 1

    def release(self) -> None:
        """Drop the observed output. Its gradient hook holds this watch (through the checks it runs), and a
        reference cycle through autograd's hook storage is one the garbage collector cannot see: kept, it held
        the output's graph, the parameters and the earlier gradients for as long as the process lived (each
        optimizer built and dropped in a sweep leaked ~6× the model)."""
        self.first_output = None

    def after(self) -> None:
        """Raise if no backward reached the parameters; warn (once) if the loss is not a function of
        softmax(output). Call after the ``with`` block (the hooks are removed on exit)."""
        if not self.active:
            return
        now = [p.grad for p in self.params]
        # new .grad tensors (zero_grad() setting .grad to None is not one)
        replaced = any(g is not None and g is not then for g, (then, _) in zip(now, self.before))
        changed = replaced or any(g is not None and g._version != v for g, (_, v) in zip(now, self.before))
        backward = self.accumulated or replaced if self.handles else changed
        if self.params and (not backward or all(g is None for g in now)):  # (None: zero_grad() after backward)
            raise RuntimeError(NO_BACKWARD)
        if self.keep_output_grads:
            self.owner["output_grads"] = self.output_grads
        self._check_scale()
        self._check_ignored_rows()
        if not self.check_output or not self.stats:
            return
        self.owner["output_checks_left"] = self.owner.get("output_checks_left", OUTPUT_CHECKS) - 1
        if self.estimating:  # from here on, only curvature-estimating steps check the output
            self.owner["estimating_output_checked"] = True
        row = float(sum(s for s, _, _ in self.stats))
        total = float(sum(t for _, t, _ in self.stats))
        if total > 0 and row > SHIFT_TOLERANCE * total:
            self.owner["output_checks_left"] = 0
            dim1 = [d for _, _, d in self.stats]
            if all(d is not None for d in dim1) and float(sum(dim1)) <= SHIFT_TOLERANCE * total:
                warnings.warn(
                    "loss='cross_entropy' but the closure's loss is a function of softmax(output) over dim 1, not "
                    "over the last dim: the output has F.cross_entropy's layout with the classes at dim 1 "
                    "([N, C, ...]), and the curvature and predict() take the classes last (the rows of the loss's "
                    "gradient with respect to the output sum to zero over dim 1, not over the last dim). Pass "
                    "output_selector=lambda out: out.movedim(1, -1) to the optimizer (and targets of shape "
                    "[N, ...] with step(closure, targets=y))", UserWarning, stacklevel=caller_stacklevel())
                return
            warnings.warn(
                "loss='cross_entropy' but the closure's loss is not a function of softmax(output): the rows "
                f"of its gradient with respect to the output do not sum to zero (relative row sum "
                f"{row / total:.2g} > {SHIFT_TOLERANCE:g}), e.g. an MSE loss on the logits. {self.categorical} "
                "If the loss is another likelihood on the outputs, pass loss='mse' "
                "for a Gaussian one, loss='binary_cross_entropy' for independent binary labels "
                "(F.binary_cross_entropy_with_logits), or compute F.cross_entropy in the closure. If the optimizer was built on a "
                "submodule (a backbone) whose output the rest of the model turns into the logits, build it on the "
                "whole model with params=backbone.parameters(). If the loss is no likelihood of the output (a GAN "
                "generator's, a contrastive or self-supervised loss), neither loss= describes it: use "
                "curvature='empirical_fisher' (the loss as written, from your backward) or VIOptimizer's default "
                "diagonal. If it is the cross-entropy plus an "
                "auxiliary term on the logits (a logit penalty, z-loss), the step is right: the curvature is the "
                "cross-entropy's and the gradient the whole loss's; silence this warning with "
                "warnings.filterwarnings('ignore', message=\"loss='cross_entropy' but\")", UserWarning,
                stacklevel=caller_stacklevel())


#: (ClosureWatch._check_scale's text)
SCALED_LOSS = ("loss='cross_entropy' but the gradient of the closure's loss with respect to the output is {ratio:.3g}× "
               "the most a mean cross-entropy gives (the sum over the rows of each row's largest entry of "
               "w·(p − y)/Σw is at most 1): is the loss scaled? A "
               "GradScaler must be given to the optimizer (grad_scaler=scaler, so that it unscales the gradients), and "
               "the loss is the mean over the batch (reduction='mean'); else the step is that many times too long and "
               "a curvature taken from your backward (empirical_fisher without targets) its square. A per-example "
               "weighting (policy-gradient advantages, importance weights) scales it too: normalise the weights, "
               "or silence it with "
               "warnings.filterwarnings('ignore', message=\"loss='cross_entropy' but the gradient\")")


#: (ClosureWatch._check_ignored_rows's text)
IGNORED_ROWS = ("{zero} of {total} rows of the output got no gradient from the closure's loss (positions "
                "F.cross_entropy(..., ignore_index=...) leaves out, padding, a mask, a zero class weight, or a loss "
                "on part of the rows), but {what}: the curvature is not that of the loss. Take the rows the loss "
                "uses: output_selector=lambda out: out[mask] (or out[:, -1], ...) and step(closure, "
                "targets=y[mask]) with the batch's mask of valid rows (README, 'Padded targets'), or silence this "
                "with warnings.filterwarnings('ignore', message='.* rows of the output got no gradient')")
#: a row whose largest predicted probability is within this of 1 may have p − y = 0 in the loss (a confident
#: prediction in float16, logits masked to the target class): not counted as left out
SATURATED = 1e-3

#: curvature estimates in which a module's block must be zero (with a nonzero gradient) before the
#: warning names it: a zero-initialised head makes the layers below it look unreached at the first
UNREACHED_LOOKS = 2
#: share of a K-FAC block's squared gradient norm on output units of zero curvature beyond which they count as
#: unreached (below it: a class whose probability's square underflows, an L2 term on a few dead units)
PARTLY_UNREACHED_SHARE = 0.01


def _wholly_unreached(blk: Any) -> bool:
    """Whether a factor of ``blk`` (a fresh block), or all of it, is zero while a parameter has a nonzero gradient."""
    return any(not bool(t.any()) for t in blk.tensors()) \
        and any(p.grad is not None and bool(p.grad.any()) for p in blk.layout.params)


def _partly_unreached(blk: Any) -> Optional[float]:
    """For a K-FAC block: the share of its squared gradient norm on the output units whose output-side factor
    ``G`` has a zero diagonal (the likelihood does not depend on them: a selector picking part of a layer's output,
    ``o[:, :D]`` of ``[mean, log-variance]``), when at least :data:`PARTLY_UNREACHED_SHARE`; else None. Zeros of the
    input side (tokens or features absent from the batch, where an L2 term or gradients accumulated over other
    batches have a gradient) do not count; nor do other shapes, whose diagonal cannot tell the two apart. Not
    called on a block :func:`_wholly_unreached` is true of (that one has its own warning)."""
    if not isinstance(blk, KFACBlock):
        return None
    grads = [p.grad for p in blk.layout.params]
    if any(g is None for g in grads):
        return None
    g_left = blk.layout.family.kfac_names()[0] == "G"
    dg = blk.left if g_left else blk.right
    zero = (dg if dg.dim() == 1 else dg.diagonal()) == 0
    if not bool(zero.any()):
        return None
    m = blk.layout.family.to_matrix(blk.layout.module, [g.detach().float() for g in grads],
                                    blk.layout.param_names).pow(2)
    total = float(m.sum())
    share = float((m[zero] if g_left else m[:, zero]).sum()) / total if total > 0 else 0.0
    return share if share >= PARTLY_UNREACHED_SHARE else None


def _looked_at(opt: Any, key: str, fresh: Dict[str, Any], test: Callable[[Any], Any],
               wait: Optional[Callable[[Any], bool]] = None) -> Dict[str, Any]:
    """The modules of ``fresh`` that ``test`` has found (a value not None or False) at each of their first
    :data:`UNREACHED_LOOKS` estimates, with the last value (each module looked at in its first estimates, also
    one first called later; ``key``: where the counts are kept). An estimate where ``wait`` is true of a module's
    block is not counted for it (the module is looked at again at the next)."""
    looks: Dict[str, int] = opt.__dict__.setdefault(key, {})
    found: Dict[str, Any] = {}
    for name, blk in fresh.items():
        seen = looks.get(name, 0)
        if seen < 0 or seen >= UNREACHED_LOOKS or (wait is not None and wait(blk)):
            continue
        value = test(blk)
        hit = value is not None and value is not False
        looks[name] = seen + 1 if hit else -1  # -1: reached, not looked at again
        if hit and seen + 1 == UNREACHED_LOOKS:
            found[name] = value
    return found


def _unreached_fix(opt: Any, skip: List[str]) -> str:
    """What to do about unreached curvature, for ``opt``'s face (``skip``: modules ``skip_modules`` may take)."""
    adaptive = getattr(opt, "adaptive", None)
    whole = "curvature='empirical_fisher'"
    plain = (f"Leave them to the plain update (skip_modules={skip!r}), or take" if skip else "Take") + \
        f" the curvature of the whole loss from your own backward ({whole}"
    if adaptive is not None and (adaptive.learning_rate or adaptive.momentum):
        return ("In adaptive mode the quadratic model has no curvature for their loss either, so the solved step "
                "overshoots it: leave adaptive mode (a fixed lr and momentum), and take the curvature of the whole "
                f"loss from your own backward ({whole} without targets=)")
    if getattr(opt, "dataset_size", None) is not None:  # VIOptimizer
        return ("The data adds no curvature there: their precision stays at its start (dataset_size·"
                f"curvature_init, fading with the EMA) plus the prior's. {plain})")
    return ("Their preconditioned step is about the gradient over the damping (bounded by kl_clip where set). "
            f"{plain} without targets=)")


def warn_unreached_blocks(opt: Any, fresh: Dict[str, Any]) -> None:
    """Warn about covered modules whose fresh block is zero (in a factor, or everywhere) while their
    parameters have a nonzero gradient, at each of their first :data:`UNREACHED_LOOKS` curvature estimates:
    the likelihood the curvature is taken from (the model output, or ``output_selector``'s pick) does not
    depend on them, the loss does (a second head whose loss the closure adds); and, apart, about K-FAC
    blocks whose output units carry a share of the gradient with zero curvature (:func:`_partly_unreached`: a
    log-variance the selector leaves out). Each warning once per optimizer."""
    if not opt.__dict__.get("_reach_warned"):
        unreached = list(_looked_at(opt, "_reach_looks", fresh, _wholly_unreached))
        if unreached:
            opt._reach_warned = True
            warnings.warn(
                f"the curvature of modules {unreached} has been zero although the loss has a gradient for their "
                "parameters: the likelihood the curvature is taken from (the model output, or output_selector's "
                "pick) does not depend on them while the loss does, e.g. a second head whose loss the closure adds. "
                f"{_unreached_fix(opt, unreached)}", UserWarning, stacklevel=caller_stacklevel())
    if not opt.__dict__.get("_partly_warned"):
        # (a block wholly zero at an estimate, below a zero-initialised head at the first, is not looked at yet)
        partly = _looked_at(opt, "_partly_looks", fresh, _partly_unreached, wait=_wholly_unreached)
        if partly:
            opt._partly_warned = True
            shares = ", ".join(f"{n!r}: {100 * v:.0f}%" for n, v in partly.items())
            warnings.warn(
                f"the curvature of modules {list(partly)} has been zero on output units that carry part of the "
                f"gradient (its squared norm there: {shares}): the likelihood the curvature is taken from (the "
                "model output, or output_selector's pick) does not depend on those units while the loss does, e.g. "
                "the rows of a layer's output that an output_selector leaves out (the log-variance of [mean, "
                "log-variance]); units no example activates (dead ReLUs) under an L2 term of the loss show so "
                f"too, harmlessly. {_unreached_fix(opt, [])}", UserWarning, stacklevel=caller_stacklevel())


def warn_blockless_modules(opt: Any, plan: Any) -> None:
    """Warn (once per optimizer) about covered modules that have had a gradient at steps after
    :data:`UNREACHED_LOOKS` curvature estimates since their first one and still have no curvature block: no
    estimating step has called them (``curv_update_interval > 1`` and a module the forward calls at the
    other steps only, e.g. two tasks alternating between batches). Looked at when the update's
    :class:`~torchsso2.optim.plan.UpdatePlan` is new (its parameters without a block, cached on it)."""
    if opt.__dict__.get("_blockless_warned") or not plan.others or opt.curv_update_interval <= 1:
        return
    names = plan.__dict__.get("blockless")
    if names is None:  # once per plan: the covered modules among the parameters without a block
        owner = {id(q): name for name, layout in opt.engine.layouts.items() for q in layout.params}
        names = plan.blockless = sorted({owner[id(plan.params[i])] for i in plan.others
                                         if id(plan.params[i]) in owner})
    if not names:
        return
    since: Dict[str, int] = opt.__dict__.setdefault("_blockless_since", {})
    now = opt.running.num_updates
    late = [n for n in names if now - since.setdefault(n, now) >= UNREACHED_LOOKS]
    if not late:
        return
    opt._blockless_warned = True
    vi = getattr(opt, "dataset_size", None) is not None
    what = ("get no weight noise (point estimates: predict() has no uncertainty from them) and the plain update of the "
            "mean" if vi else "take the plain update (the learning rate and momentum on their gradient, scaled by the "
            "KL clip where set)")
    warnings.warn(
        f"modules {late} have had a gradient but still have no curvature: the curvature is estimated once every "
        f"{opt.curv_update_interval} steps (curv_update_interval={opt.curv_update_interval}) and no estimating step "
        "has called them (e.g. tasks alternating between batches), so "
        f"they {what}. Call them at the estimating steps too (every task's loss in each step's closure), or estimate "
        "at every step (curv_update_interval=1)", UserWarning, stacklevel=caller_stacklevel())


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """``model.eval()`` for the duration; every submodule's ``training`` flag restored on exit."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


def warn_ignored_schedule(opt: Any) -> None:
    """Warn once when a param group's ``lr`` (with ``use_adaptive_learning_rate``) or ``momentum`` (with
    ``use_adaptive_momentum``) changed since the first adaptive step: the adapted coefficient ignores it, so
    a scheduler or a hand-set value has no effect (docs/adaptive.md). Compared with the values the first
    step saw (a few floats per step); a group added later is compared from the step after it."""
    adaptive = opt.adaptive
    if opt.__dict__.get("_schedule_warned") or not (adaptive.learning_rate or adaptive.momentum):
        return
    keys = [k for k, on in (("lr", adaptive.learning_rate), ("momentum", adaptive.momentum)) if on]
    now = [tuple(g[k] for k in keys) for g in opt.param_groups]
    seen = opt.__dict__.setdefault("_schedule_seen", now)
    if now == seen:
        return
    if len(now) != len(seen) and now[:len(seen)] == seen:  # a group added since: compared from now on
        opt._schedule_seen = now
        return
    opt._schedule_warned = True
    changed = [k for i, k in enumerate(keys) if any(a[i] != b[i] for a, b in zip(now, seen))] or keys
    flags = {"lr": "use_adaptive_learning_rate=True", "momentum": "use_adaptive_momentum=True"}
    warnings.warn(
        f"the param groups' {' and '.join(repr(k) for k in changed)} changed since the first step (a scheduler or "
        f"a hand-set value), but with {' and '.join(flags[k] for k in changed)} the optimizer solves "
        f"{'them' if len(changed) == 2 else 'it'} from the quadratic model at every step and ignores the groups' "
        "value: the change has no effect (docs/adaptive.md)", UserWarning, stacklevel=caller_stacklevel())
