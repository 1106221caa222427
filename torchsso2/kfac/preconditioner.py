"""``KFACPreconditioner``: a drop-in for kfac_pytorch's (KAISA) preconditioner.

Switch by changing the import::

    from torchsso2.kfac import KFACPreconditioner        # was: from kfac.preconditioner import ...

    preconditioner = KFACPreconditioner(model, lr=0.1, damping=0.003)
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        preconditioner.step()        # rewrites p.grad of every registered layer
        optimizer.step()

The per-layer math comes from the curvature engine (:mod:`curvature.modules` for the
factors, :mod:`curvature.linalg` for the decompositions), scaled as kfac_pytorch scales it
(:mod:`torchsso2.kfac.factors`); distribution from :mod:`torchsso2.distributed`. See
``docs/kfac.md`` for the formulas, the cadence and the KAISA placement.
"""
from __future__ import annotations

import logging
import math
import numbers
from collections import defaultdict
import warnings
import weakref
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn

from curvature.capture import on_gradient
from curvature.cost import warn_kfac_factors
from curvature.engine import compile_advice, compiled_before_hooks, contains_compiled
from curvature.hook_marks import is_inert, register_owner, warn_if_attached
from torchsso2.optim.accelerate_checks import warn_if_not_sync_step
from torchsso2.optim.changed_model import sharded_failure
from curvature.linalg import Backend, get_backend
from curvature.options import float_or_inf
from curvature.sharded import sharded_since, sharding_of
from curvature.stacklevel import caller_stacklevel
from torchsso2.distributed import Communicator, WorkAssignment, get_communicator
from torchsso2.distributed.consistency import check_kfac_settings
from torchsso2.optim.copying import copy_fields
from torchsso2.optim.misuse import check_model_argument

from .arguments import check_dtype, resolve_grad_worker_fraction
from .base_preconditioner import BaseKFACPreconditioner, parse_flag
from .enums import AllreduceMethod, AssignmentStrategy, ComputeMethod, DistributedStrategy, parse_choice
from .hyperparams import ClipSchedule, Schedule
from .hooks import attach_forward_hooks, weak_grad_hook
from .kaisa import KAISAComm
from .kl_clip import kl_clip_scale
from .layer import KFACLayer, grad_scale_of
from .nonfinite import (SkipPolicy, decompositions_before, nonfinite_entries, nonfinite_results,
                        restore_decompositions)
from .register import attention_out_projections, find_layers
from .state import EXTENSION, HYPERPARAMS, decompositions_state, layers_state, validate_state

logger = logging.getLogger(__name__)

__all__ = ["KFACPreconditioner"]


def _live_hook(handle: Any) -> bool:
    """Whether the hook ``handle`` registered is still in place as registered: not gone, not the inert copy
    an unpickled model holds in its place (:class:`curvature.hook_marks.LocalHook`); a shallow copy of the
    preconditioner shares the original's live hooks."""
    hooks = handle.hooks_dict_ref()
    fn = None if hooks is None else hooks.get(handle.id)
    return fn is not None and not is_inert(fn)


class KFACPreconditioner(BaseKFACPreconditioner):
    """K-FAC gradient preconditioner with KAISA distribution (kfac_pytorch's interface).

    Registers ``nn.Linear`` and ``nn.Conv2d`` leaf modules of ``model`` (see
    :func:`~torchsso2.kfac.register.find_layers`); hooks record layer inputs in the forward
    pass and output gradients in the user's backward pass (only in training mode, with grad
    enabled, on factor-update steps). :meth:`step` replaces ``p.grad`` of the registered
    layers by the KL-clipped preconditioned gradient; call it after ``loss.backward()``
    (after DDP has averaged gradients) and before ``optimizer.step()``.

    Args (names, defaults and meaning as kfac_pytorch):
        model: the model (may be wrapped in ``DistributedDataParallel``).
        factor_update_steps: steps between factor updates (int or callable of the step).
        inv_update_steps: steps between recomputing the decompositions (int or callable).
        damping: Tikhonov damping (float or callable), ``> 0``.
        factor_decay: running-average coefficient of the factors, in ``(0, 1]`` (a callable may
            also return ``0``: the factors are replaced by the new batch, e.g.
            :func:`~torchsso2.kfac.hyperparams.exp_decay_factor_averaging` at steps 0 and 1).
        kl_clip: KL clipping parameter, ``> 0``, or a callable of the step (returning ``None``: no
            clipping at that step; ``kl_clip=None`` itself is a ``TypeError``, as in kfac_pytorch).
        lr: learning rate used by the KL clip, ``>= 0``.
        accumulation_steps: forward/backward passes per optimization step.
        allreduce_bucket_cap_mb: all-reduce bucket size in MiB (``0``: one all-reduce per factor).
        assignment_strategy: ``COMPUTE`` (cost ``n³``) or ``MEMORY`` (``n²``) for balancing
            the decompositions over ranks.
        colocate_factors: decompose A and G of a layer on the same rank (switched on, with a
            warning, when the grad-worker fraction is ``MEM_OPT``, as kfac_pytorch does).
        compute_method: ``EIGEN`` or ``INVERSE``.
        compute_eigenvalue_outer_product: with ``EIGEN``, the G worker precomputes
            ``1/(λ_G λ_Aᵀ + damping)`` (needs ``colocate_factors=True``).
        grad_worker_fraction: fraction of ranks preconditioning each layer's gradient, in
            ``[0, 1]`` (``0`` means ``1/world_size``), or a :class:`DistributedStrategy`
            (``COMM_OPT`` = 1, ``MEM_OPT`` = 1/world_size, ``HYBRID_OPT`` = 0.5).
        symmetry_aware: communicate only the upper triangle of symmetric matrices.
        grad_scaler: AMP ``GradScaler`` (its ``get_scale()``) or a callable returning the
            loss scale; output gradients are divided by it before the G factor is formed.
        factor_dtype: dtype of the factors (``None``: the training dtype).
        inv_dtype: dtype of the stored decompositions.
        skip_layers: regexes; a module whose name or class name matches is not registered.
        update_factors_in_hook: fold factor batches into the running averages in the backward
            hook of the last micro-batch (``True``) or at the start of :meth:`step`.
        linalg: linear-algebra backend of the decompositions (``"torch"``, ``"cupy"``,
            ``"numpy"`` or a :class:`curvature.linalg.Backend`); ``None``: ``$TORCHSSO2_LINALG``, else
            ``"torch"`` (resolved once, here).
        communicator: ``"auto"``, ``"none"``, ``"torch"``, ``"mpi"`` or a ``Communicator``.
            Selecting MPI installs the process-wide fault handlers (an uncaught exception calls
            ``MPI_Abort``, a rank that exits tells the others; opt out with
            ``TORCHSSO2_ABORT_ON_EXCEPTION=0`` or ``get_communicator("mpi", abort_on_exception=False)``);
            collectives give up after ``TORCHSSO2_DIST_TIMEOUT`` s (60). The ranks' settings are
            compared at construction (``ValueError`` naming any that differ). See docs/distributed.md.
        loglevel: level of the registration, assignment and communicator-choice log messages.
        on_nonfinite: ``"skip"`` (default) or ``"raise"``: what :meth:`step` does when a gradient
            of a registered layer or a factor updated in this step is NaN/inf. Either way the
            preconditioner's state (factors, decompositions, ``steps``) and the gradients are left
            exactly as before the step; ``"skip"`` logs a warning, counts it in ``num_skipped``
            and sets ``last_step_skipped`` (skip ``optimizer.step()`` then), ``"raise"`` raises
            :class:`~torchsso2.NonFiniteError`. Not with a ``grad_scaler``'s overflow, which
            keeps kfac_pytorch's handling. See :mod:`torchsso2.kfac.nonfinite`.
        max_consecutive_skips: under ``"skip"``, raise :class:`~torchsso2.NonFiniteError` (the run
            diverged) after this many skipped steps in a row (``None``: never).

    Raises:
        ValueError / TypeError: a bad argument (the message names it and what was expected);
            an unknown ``compute_method`` / ``assignment_strategy`` name raises
            :class:`~torchsso2.kfac.enums.UnknownChoiceError` (a ``KeyError`` and a ``ValueError``).

    Besides kfac_pytorch's attributes (``allreduce_method``, ``tdc``, ``distributed_strategy``,
    ``grad_worker_fraction``, ...; see docs/kfac.md), ``comm`` is the communicator (``tdc`` is
    the same object), ``assignment`` the KAISA placement and ``layers`` name → layer state.
    """

    # the public attributes, for type checkers (kfac_pytorch's names; docs/kfac.md)
    assignment: WorkAssignment
    assignment_strategy: AssignmentStrategy
    compute_method: ComputeMethod
    colocate_factors: bool
    compute_eigenvalue_outer_product: bool
    symmetry_aware: bool
    factor_dtype: Optional[torch.dtype]
    inv_dtype: torch.dtype
    distributed_strategy: DistributedStrategy
    grad_worker_fraction: float
    grad_scaler: Optional[Any]
    allreduce_bucket_cap_mb: float
    allreduce_method: AllreduceMethod
    skip_layers: Sequence[str]
    layers: Dict[str, KFACLayer]
    comm: Communicator
    tdc: Communicator

    def __init__(
        self,
        model: nn.Module,
        *,
        factor_update_steps: Schedule = 1,
        inv_update_steps: Schedule = 1,
        damping: Schedule = 0.001,
        factor_decay: Schedule = 0.95,
        kl_clip: ClipSchedule = 0.001,
        lr: Schedule = 0.1,
        accumulation_steps: int = 1,
        allreduce_bucket_cap_mb: float = 25.0,
        assignment_strategy: Union[AssignmentStrategy, str, Enum] = AssignmentStrategy.COMPUTE,
        colocate_factors: bool = True,
        compute_method: Union[ComputeMethod, str, Enum] = ComputeMethod.EIGEN,
        compute_eigenvalue_outer_product: bool = True,
        grad_worker_fraction: Union[DistributedStrategy, Enum, float] = DistributedStrategy.COMM_OPT,
        symmetry_aware: bool = False,
        grad_scaler: Optional[Union[Any, Callable[[], float]]] = None,
        factor_dtype: Optional[torch.dtype] = None,
        inv_dtype: torch.dtype = torch.float32,
        skip_layers: Optional[Sequence[str]] = None,
        update_factors_in_hook: bool = True,
        linalg: Union[str, Backend, None] = None,
        communicator: Union[str, Communicator] = "auto",
        loglevel: int = logging.DEBUG,
        on_nonfinite: str = "skip",
        max_consecutive_skips: Optional[int] = 20,
    ) -> None:
        check_model_argument(model, "KFACPreconditioner", "skip_layers")
        self._init_hyperparams(
            factor_update_steps=factor_update_steps, inv_update_steps=inv_update_steps, damping=damping,
            factor_decay=factor_decay, kl_clip=kl_clip, lr=lr, accumulation_steps=accumulation_steps,
            update_factors_in_hook=update_factors_in_hook, loglevel=loglevel, stacklevel=3,
        )
        if isinstance(allreduce_bucket_cap_mb, bool) or not isinstance(allreduce_bucket_cap_mb, numbers.Real):
            raise TypeError(f"allreduce_bucket_cap_mb must be a float >= 0, got {allreduce_bucket_cap_mb!r}")
        if not (math.isfinite(float_or_inf(allreduce_bucket_cap_mb)) and allreduce_bucket_cap_mb >= 0):
            raise ValueError(f"allreduce_bucket_cap_mb must be a finite float >= 0 (0: no bucketing), got "
                             f"{allreduce_bucket_cap_mb!r}")
        self.assignment_strategy = parse_choice(assignment_strategy, AssignmentStrategy, "assignment_strategy")
        self.compute_method = parse_choice(compute_method, ComputeMethod, "compute_method")
        self.colocate_factors = parse_flag("colocate_factors", colocate_factors)
        self.compute_eigenvalue_outer_product = parse_flag("compute_eigenvalue_outer_product",
                                                           compute_eigenvalue_outer_product)
        self.symmetry_aware = parse_flag("symmetry_aware", symmetry_aware)
        self.factor_dtype = check_dtype("factor_dtype", factor_dtype, optional=True)
        self.inv_dtype = check_dtype("inv_dtype", inv_dtype, optional=False)
        if grad_scaler is not None and not (callable(getattr(grad_scaler, "get_scale", None)) or callable(grad_scaler)):
            raise TypeError(f"grad_scaler must be a GradScaler, a callable returning the scale, or None; "
                            f"got {type(grad_scaler).__name__}")
        if (self.compute_method is ComputeMethod.EIGEN and self.compute_eigenvalue_outer_product
                and not self.colocate_factors):
            raise ValueError("compute_eigenvalue_outer_product=True (with compute_method=EIGEN) needs "
                             "colocate_factors=True; set one of them to the other value")

        self.comm = (communicator if not isinstance(communicator, str)
                                   else get_communicator(communicator, loglevel=self.loglevel))
        if not isinstance(self.comm, Communicator):
            raise TypeError(f"communicator must be a backend name or a Communicator, got {type(communicator).__name__}")
        world = self.comm.world_size
        fraction, self.distributed_strategy = resolve_grad_worker_fraction(grad_worker_fraction, world)
        if self.distributed_strategy is DistributedStrategy.MEM_OPT and not self.colocate_factors:
            warnings.warn("grad_worker_frac=1/world_size (MEM_OPT) requires colocate_factors=True. "
                          "Enabling colocate_factors.", stacklevel=2)
            self.colocate_factors = True
        self.grad_worker_fraction = fraction
        self.backend = get_backend(linalg)
        self.grad_scaler = grad_scaler
        self.allreduce_bucket_cap_mb = float(allreduce_bucket_cap_mb)
        self.allreduce_method = (AllreduceMethod.ALLREDUCE_BUCKETED if self.allreduce_bucket_cap_mb > 0
                                 else AllreduceMethod.ALLREDUCE)

        prediv = self.compute_method is ComputeMethod.EIGEN and self.compute_eigenvalue_outer_product
        self.layers = {}
        for name, module, family in find_layers(model, [] if skip_layers is None else skip_layers):
            layer = KFACLayer(name, module, family, self.compute_method, prediv, self.factor_dtype,
                              self.inv_dtype, self.backend)
            self.layers[name] = layer
            logger.log(self.loglevel, "Registered name=%r: %r", name, layer)
        out_projs = attention_out_projections(model)  # warned about at registration: not again at step()
        self._unrecorded_warned = {n for n, layer in self.layers.items() if id(layer.module) in out_projs}
        # checked by find_layers; a ListConfig or tuple from a config stored as kfac_pytorch's list
        self.skip_layers = [] if skip_layers is None else list(skip_layers)
        holders: Dict[int, str] = {}
        for name, layer in self.layers.items():
            for p in layer.params:
                if id(p) in holders:
                    warnings.warn(f"KFACPreconditioner: layers {holders[id(p)]!r} and {name!r} share a parameter "
                                  f"(tied weights); each preconditions the shared gradient with its own factors and "
                                  f"the last registered layer's result is kept (kfac_pytorch keeps the first's). "
                                  f"Leave one of them out with skip_layers", stacklevel=2)
                holders.setdefault(id(p), name)
        registered = {layer.module for layer in self.layers.values()}
        for other, module in model.named_modules(remove_duplicate=False):  # a parameter shared with a module not
            # registered (an Embedding tied to a registered head): its gradient holds that use's part too
            if module in registered:
                continue
            for p in module.parameters(recurse=False):
                if id(p) in holders:
                    warnings.warn(f"KFACPreconditioner: layer {holders[id(p)]!r} shares a parameter with module "
                                  f"{other!r}, which is not registered (tied weights); step() preconditions the "
                                  "summed gradient of both uses with the layer's factors alone (kfac_pytorch does "
                                  f"the same, silently). Leave the layer out with skip_layers=[{holders[id(p)]!r}] "
                                  "for the plain gradient", stacklevel=2)
        # announce factors too large to decompose often (an LM head's [V, V]: curvature/cost.py)
        dtype = self.factor_dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        warn_kfac_factors({name: list(layer.sizes.values()) for name, layer in self.layers.items()},
                          torch.finfo(dtype).bits // 8,
                          fixes="skip_layers=[{name!r}] (its gradient then stays plain) or a longer inv_update_steps",
                          inverse=self.compute_method is ComputeMethod.INVERSE)
        if not self.layers:
            warnings.warn("KFACPreconditioner: the model has no nn.Linear / nn.Conv2d layer to precondition "
                          "(after skip_layers); step() will leave the gradients unchanged", stacklevel=2)
        self._by_module = {layer.module: layer for layer in self.layers.values()}
        check_kfac_settings(self.comm, locals())  # ranks agree on the schedule before any collective

        sizes = {name: dict(layer.sizes) for name, layer in self.layers.items()}
        self.assignment = WorkAssignment.from_sizes(sizes, world, fraction, self.assignment_strategy,
                                                    self.colocate_factors)
        logger.log(self.loglevel, "KFAC layer assignments (KAISAAssignment):\n%s", self.assignment.summary())
        self._kaisa = KAISAComm(self.comm, self.assignment, self.allreduce_bucket_cap_mb, self.symmetry_aware)
        self.tdc = self.comm  # kfac_pytorch's name for the communicator
        self._init_layers({layer.module: (name, layer) for name, layer in self.layers.items()}, self.assignment,
                          self.comm, self._defaults_for_repr())
        self._updated: set = set()
        #: per layer, the recorded calls of this step whose output gradient has not come yet
        self._awaiting: Dict[str, int] = defaultdict(int)
        self._skips = SkipPolicy(on_nonfinite, max_consecutive_skips)
        # weak hooks: dropping the preconditioner removes them (torchsso2/kfac/hooks.py)
        self._model = model
        self._attach_hooks()
        self._remember_parameters()
        #: the model's modules at construction: only a module added since can be a replacing layer
        self._modules_at_start = {id(m) for m in model.modules()}
        self._replaced_warned = False
        self._attached_checked = False  # other live preconditioners on the layers: at the first step()
        self._sync_warned = False  # a step() on a micro-batch accelerate does not step on (accelerate_checks.py)
        self._model_is_compiled = contains_compiled(model)
        #: micro-batches recorded in this step (for the fold in the hooks): forwards of the whole model, where
        #: forwards with no backward between them count once (two views through the model, one backward)
        self._micro_batches = 0
        #: whether a recorded gradient arrived since the last counted forward of the model
        self._backward_seen = False
        #: registered-layer calls with and without rows in the current forward of the model (an empty batch: none with)
        self._calls_with_rows = self._calls_without_rows = 0
        #: open curvature.hook_marks.HiddenPasses contexts: a native optimizer's own passes, not recorded
        self._hidden_passes = 0

    def _defaults_for_repr(self) -> Dict[str, Any]:
        return {
            "allreduce_bucket_cap_mb": self.allreduce_bucket_cap_mb, "allreduce_method": self.allreduce_method,
            "assignment_strategy": self.assignment_strategy, "colocate_factors": self.colocate_factors,
            "compute_eigenvalue_outer_product": self.compute_eigenvalue_outer_product,
            "compute_method": self.compute_method, "distributed_strategy": self.distributed_strategy,
            "grad_worker_fraction": self.grad_worker_fraction, "grad_scaler": self.grad_scaler is not None,
            "factor_dtype": self.factor_dtype, "inv_dtype": self.inv_dtype, "skip_layers": self.skip_layers,
            "symmetry_aware": self.symmetry_aware, "world_size": self.comm.world_size,
        }

    # ---- hooks ------------------------------------------------------------------------------
    def _forward_hook(self, module: nn.Module, inputs: Tuple[Any, ...], output: Any) -> Optional[Tensor]:
        if not module.training or not torch.is_grad_enabled() or self._hidden_passes:
            # (_hidden_passes: a SecondOrderOptimizer's / VIOptimizer's own passes, hook_marks.HiddenPasses)
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        if torch._C._functorch.is_functorch_wrapped_tensor(output):
            # a forward inside torch.func (vmap / grad of functional_call, e.g. per-sample gradients): its
            # tensors live only inside the transform; recording them would break every later step
            return
        if self._steps % self.factor_update_steps != 0:
            return
        layer = self._by_module.get(module)
        if layer is None:  # not one of ours: a deep copy of the model carries our hook to its own layers
            return
        if output.numel() == 0:
            # a call on no rows (a mixture-of-experts expert no example was routed to) adds nothing to the factors,
            # as under kfac_pytorch: not recorded (no registered layer with rows in a forward: _model_forward_hook)
            self._calls_without_rows += 1
            return None
        self._calls_with_rows += 1
        self._mini_steps[layer.name] += 1
        self._awaiting[layer.name] += 1
        saved = tuple(i.detach() if isinstance(i, Tensor) else i for i in inputs)
        # after the hooks on the output, as kfac_pytorch's backward hook (a user's out.register_hook(2·g))
        # one record per call: a second backward through it (retain_graph=True) adds only its G
        call = {"inputs": saved, "mini_step": self._mini_steps[layer.name], "seen": False}
        on_gradient(output, weak_grad_hook(self, "_grad_hook", layer, call))
        # a view output (Linear on [N, T, d]): an in-place op after the layer (ReLU(inplace=True), h += x) would
        # rebase the view's autograd node and the hook on it would never run; the layer returns a copy instead
        return output.clone() if output._is_view() else None

    def _reset_step_counts(self) -> None:
        """Forget the calls recorded in this step (after a step, a skip, a loaded checkpoint)."""
        self._mini_steps.clear()
        self._awaiting.clear()
        self._micro_batches = 0
        self._backward_seen = False

    def _model_forward_hook(self, module: nn.Module, inputs: Tuple[Any, ...], output: Any) -> None:
        if not (module.training and torch.is_grad_enabled() and self._steps % self.factor_update_steps == 0) \
                or self._hidden_passes:
            return
        if isinstance(output, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(output):
            return
        empty = self._calls_without_rows and not self._calls_with_rows
        self._calls_with_rows = self._calls_without_rows = 0
        if empty:  # every registered layer this forward called ran on no rows: an empty batch
            raise ValueError("KFACPreconditioner: the model ran on an empty batch (every registered layer it called "
                             "had no rows); its factors would be undefined: skip empty batches in the training loop "
                             "(e.g. DataLoader(..., drop_last=True) or `if len(x) == 0: continue`; with several "
                             "processes every rank must skip the same steps, as drop_last=True with a "
                             "DistributedSampler does)")
        if self._micro_batches == 0 or self._backward_seen:
            self._micro_batches += 1
            self._backward_seen = False

    def _fold_in_hook(self, layer: KFACLayer, mini_step: int) -> bool:
        """Whether this gradient completes the step's batches of ``layer``: the ``accumulation_steps``-th
        micro-batch (forwards of the whole model with a backward between them; the layer's ``mini_step``-th
        call where the model's forward is not seen) and no earlier call of the layer still awaiting its gradient (a layer
        called several times per forward gets them in reverse order). What no hook folds is folded
        at the start of :meth:`step`."""
        if self._awaiting[layer.name]:
            return False
        count = self._micro_batches if self._micro_batches else mini_step
        return count % self._accumulation_steps == 0

    def _grad_hook(self, layer: KFACLayer, call: Dict[str, Any], grad: Tensor) -> None:
        if self._hidden_passes:  # a backward pass of a native optimizer's curvature through the user's forward
            return
        first = not call["seen"]
        # the schedule a fold here reads, evaluated before this batch touches any layer: a bad value
        # raises out of backward() with every layer's statistics as they were
        decay = self.factor_decay if self.update_factors_in_hook else None
        self._backward_seen = True  # the next forward of the model starts another micro-batch
        with torch.no_grad():
            # A is taken with the first backward whose contribution is kept; an AMP overflow is skipped and
            # counts for nothing (a later backward through the same forward takes its place; what no hook
            # folds is folded at the start of step())
            if not layer.accumulate(call["inputs"], grad.detach(), grad_scale_of(self.grad_scaler), with_a=first):
                return
            call["seen"] = True
            if first:
                self._awaiting[layer.name] -= 1
            if decay is not None and self._fold_in_hook(layer, call["mini_step"]):
                if layer.update_factors(decay):
                    self._updated.add(layer.name)

    def hooked_modules(self) -> List[nn.Module]:
        """The modules this preconditioner's forward hooks are on: its layers and the model."""
        return [layer.module for layer in self.layers.values()] + [self._model]

    def _attach_hooks(self) -> None:
        self._handles = attach_forward_hooks(self, [layer.module for layer in self.layers.values()], "_forward_hook")
        self._handles += attach_forward_hooks(self, [self._model], "_model_forward_hook")
        register_owner(self)  # a native optimizer's own passes are hidden from it (curvature.hook_marks)

    def __deepcopy__(self, memo: Dict[int, Any]) -> "KFACPreconditioner":
        """``copy.deepcopy((model, precond))``: an independent preconditioner whose hooks are on the
        copied model (the copy of a model carries the original's hooks, which ignore it: they are
        dropped from the copy), with its factors, decompositions and counters copied, so both continue
        identically. Copying the preconditioner alone copies its model too (as the native optimizers
        do). Not supported with several processes (a communicator cannot be copied): ``TypeError``."""
        new = copy_fields(self, memo, "a KFACPreconditioner", "a new one", "precond", "_handles".__eq__)
        new._handles = []
        new._hidden_passes = 0  # (copied inside a native optimizer's hidden pass: the copy records from its next step)
        # a copy of a copy still waiting to attach (its model not built when it was made) attaches as the original
        # would; one detached with remove_hooks() stays detached
        pending = new.__dict__.pop("_settle_pending", None)
        attach_pending = new.__dict__.pop("_attach_pending", False)
        stale = {h.id for h in self._handles} | (pending[0] if pending is not None else set())
        settle = (stale, bool(self._handles) or (pending is not None and pending[1]) or attach_pending)
        try:
            new._settle_copy(*settle)
        except AttributeError:  # copied as an attribute of the model it preconditions, not built yet: at step()
            new._detach_partial()
            new._settle_pending = settle
        return new

    def _detach_partial(self) -> None:
        """Remove the hooks an attach that failed half way registered (the layers built, the model not yet)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _settle_copy(self, stale: Set[int], attach: bool) -> None:
        """A deep copy's hooks: the original's dropped from the copied modules, its own attached."""
        for module in self.hooked_modules():
            for hooks in (module._forward_hooks, module._forward_hooks_with_kwargs,
                          module._forward_hooks_always_called):
                for key in stale.intersection(hooks):
                    del hooks[key]
        self._remember_parameters()
        self._modules_at_start = {id(m) for m in self._model.modules()}
        if attach:
            self._attach_hooks()

    def __getstate__(self) -> Dict[str, Any]:
        """Pickling: the weak references to the construction-time parameters do not pickle; the unpickled
        preconditioner takes its (unpickled) model's parameters as the baseline."""
        if self.comm.world_size > 1:
            raise TypeError("pickling a KFACPreconditioner that communicates over several processes is not supported "
                            "(its communicator, a process group, cannot be pickled; torch.save of a model holding it "
                            "pickles it too): torch.save(precond.state_dict(), path) and load_state_dict it into "
                            "the preconditioner the next run builds")
        state = dict(self.__dict__)
        state.pop("_born", None)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._hidden_passes = 0
        self._remember_parameters()
        if self._handles and not any(_live_hook(h) for h in self._handles):
            # unpickled while attached: the unpickled model's hooks are inert copies of ours (LocalHook). Attached
            # again; a model that holds this preconditioner is not built yet here: then at the first step()
            for h in self._handles:
                h.remove()  # (the inert copies)
            self._handles = []
            try:
                self._attach_hooks()
            except AttributeError:
                self._detach_partial()
                self._attach_pending = True

    def remove_hooks(self) -> None:
        """Detach the preconditioner from the model (the hooks are removed; dropping the
        preconditioner removes them too, see :mod:`torchsso2.kfac.hooks`)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # ---- the step ------------------------------------------------------------------------------
    def _warn_scaled_gradients(self) -> None:
        """Once: a GradScaler whose scale is not 1 and which has unscaled no optimizer's gradients this step
        (``scaler.unscale_(optimizer)`` before ``step()``, as kfac_pytorch requires): the gradients are still
        scaled, and the KL clip then shrinks every step (an MLP stayed at 10% accuracy, as under kfac_pytorch)."""
        states = getattr(self.grad_scaler, "_per_optimizer_states", None)
        if states is None or self.__dict__.get("_scaled_grads_warned") or grad_scale_of(self.grad_scaler) == 1.0:
            return
        from torch.amp.grad_scaler import OptState
        if not any(s.get("stage") is OptState.UNSCALED for s in states.values()):
            self._scaled_grads_warned = True
            warnings.warn("KFACPreconditioner(grad_scaler=...): step() found the gradients still scaled (the scaler "
                          "has unscaled no optimizer's gradients since its last update()): call "
                          "scaler.unscale_(optimizer) before preconditioner.step(), as kfac_pytorch requires, "
                          "then scaler.step(optimizer) and scaler.update() (every optimizer holding a registered "
                          "layer: only whether any was unscaled is seen)", UserWarning, stacklevel=caller_stacklevel())

    def _check_model_unchanged(self, layers: List[KFACLayer]) -> Set[str]:
        """At a factor step in which some forwards were recorded: a ValueError when registered layers that this
        step did not record are no longer in the model (by identity) and the model now holds ``nn.Linear`` /
        ``nn.Conv2d`` layers that would be registered and are not (a layer replaced after the preconditioner
        was built, ``model.head = nn.Linear(...)``: the new one would never be preconditioned). A registered
        layer removed without a replacement (an auxiliary head dropped), or wrapped in place, is left alone.
        Every rank reaches the same verdict from its model, before any collective of the step. Then, once, a
        UserWarning for layers whose parameter objects were replaced since construction
        (``load_state_dict(..., assign=True)``): an optimizer built before holds the old ones.

        Returns:
            the names of the registered layers no longer in the model (removed: not warned about as unrecorded).
        """
        gone: List[str] = []
        if not any(self._mini_steps.values()):
            return set()
        unrecorded = [layer for layer in layers if not self._mini_steps.get(layer.name)]
        if unrecorded:
            inside = {id(m) for m in self._model.modules()}
            gone = [layer.name for layer in unrecorded if id(layer.module) not in inside]
            new = self._unregistered_layers() if gone else []
            if new:  # (step() forgets what this step recorded)
                raise ValueError(
                    f"KFACPreconditioner: registered layers {gone} are no longer in the model and it holds layers "
                    f"{new} that are not registered: a layer replaced after the preconditioner was built (e.g. "
                    "model.head = nn.Linear(...)) would never be preconditioned. Build a new KFACPreconditioner "
                    "(and optimizer) after changing the model")
        if not self._replaced_warned:
            # (a parameter gone from the module, a reparametrization, is layer.params' error: not counted here)
            moved = [layer.name for layer in layers
                     if None not in (now := _held_now(layer))
                     and any(ref() is not p for ref, p in zip(self._born[layer.name], now))]
            how = sharding_of(self._model) if moved else None
            if how is not None:  # sharded since: say that, before any collective
                raise ValueError(f"KFACPreconditioner.step failed because {sharded_since(how, 'KFACPreconditioner')}")
            # (an old parameter still alive is held by something: an optimizer built before the replacement)
            own = {id(p) for p in self._model.parameters()} if moved else set()
            stale = moved and any((p := ref()) is not None and id(p) not in own
                                  for refs in self._born.values() for ref in refs)
            if moved and not stale:  # nothing holds the old ones: the new parameters are the baseline from here on
                self._remember_parameters()
            if stale:
                self._replaced_warned = True
                warnings.warn(f"KFACPreconditioner: the parameters of registered layers {moved} were replaced since it "
                              "was built (load_state_dict(..., assign=True), model.to_empty(...), a wrapper that "
                              "re-creates them), and something still holds the old ones: typically an optimizer "
                              "built before the replacement, which then no longer moves the model (or tensors and "
                              "graphs kept from before it). The preconditioner follows the new parameters; build the "
                              "optimizer (and preconditioner) after loading, materializing or wrapping the model",
                              UserWarning, stacklevel=caller_stacklevel())
        return set(gone)

    def _remember_parameters(self) -> None:
        """Each layer's parameter objects as its module holds them now, weakly (a replacement since is warned
        about once, and only while an old one lives on: :meth:`_check_model_unchanged`)."""
        self._born: Dict[str, Tuple[Callable[[], Optional[nn.Parameter]], ...]] = {
            name: tuple(_NONE if p is None else weakref.ref(p) for p in _held_now(layer))
            for name, layer in self.layers.items()}

    def _unregistered_layers(self) -> List[str]:
        """Names of the model's layers that ``find_layers`` would register now, that are not registered and
        that were not in the model at construction (a layer frozen then and unfrozen since is not new)."""
        registered = {id(layer.module) for layer in self.layers.values()}
        try:
            with warnings.catch_warnings():  # (its registration warnings were given at construction)
                warnings.simplefilter("ignore")
                found = find_layers(self._model, self.skip_layers)
        except Exception:  # a layer it would refuse: not one that would be preconditioned
            return []
        return [name for name, module, _ in found
                if id(module) not in registered and id(module) not in self._modules_at_start]

    def _warn_factorless(self, layers: List[KFACLayer], factor_step: bool) -> None:
        """Once: registered layers that have had a gradient at steps after two factor updates since their first
        one and still have no factors (the forward calls them between factor steps only, e.g. two tasks
        alternating between batches with ``factor_update_steps=2``): their gradients stay unpreconditioned
        (kfac_pytorch raises "Cannot eigendecompose A before A has been computed"). The layers without factors
        are listed again at factor steps only, so a step of a model whose layers all have factors pays nothing."""
        state = self.__dict__
        if state.get("_factorless_warned"):
            return
        if factor_step or state.get("_factorless") is None:
            state["_factor_updates"] = state.get("_factor_updates", 0) + int(factor_step)
            state["_factorless"] = [layer for layer in layers if not layer.has_factors()]
        if factor_step:  # a layer with a gradient and no recorded forward at a factor step: _warn_unrecorded's case
            return
        bare = [layer.name for layer in state["_factorless"]
                if layer.has_grad() and layer.name not in self._unrecorded_warned]
        if not bare:
            return
        since: Dict[str, int] = state.setdefault("_factorless_since", {})
        now = state["_factor_updates"]
        late = [name for name in bare if now - since.setdefault(name, now) >= 2]
        if late:
            self._factorless_warned = True
            warnings.warn(f"KFACPreconditioner: registered layer(s) {late} have had gradients but still have no factors: "
                          "no factor step has recorded their forward and backward (the "
                          "factors update at every factor_update_steps-th step, and the forward calls them at the "
                          "other steps only, e.g. tasks alternating between batches), so their gradients stay "
                          "unpreconditioned (kfac_pytorch raises here). Call them at the factor steps too (every "
                          "task's loss in each step's backward), or update the factors at every step "
                          "(factor_update_steps=1)", UserWarning, stacklevel=caller_stacklevel())

    def _warn_unrecorded(self, layers: List[KFACLayer], exempt: Set[str]) -> None:
        """Once per layer: a registered layer with a nonzero gradient and no forward recorded in a factor step in
        which other layers' forwards were (its weight used without calling it, e.g. ``F.linear(x, layer.weight)``,
        or the layer run in eval mode): its gradient stays unpreconditioned, or is preconditioned with factors
        that no longer update, silently under kfac_pytorch. Not for the layers in ``exempt``: those another rank
        recorded (updated on any rank; DDP gives this rank its averaged gradient) and those removed from the model."""
        if not any(self._mini_steps.values()):
            return
        warned = self._unrecorded_warned
        # (a head this step did not call has a zero gradient, or a DDP average of the ranks that called it)
        names = [layer.name for layer in layers if layer.name not in warned and not self._mini_steps.get(layer.name)
                 and layer.name not in exempt
                 and layer.has_grad() and any(bool(p.grad.any()) for p in layer.params)]
        if names:
            warned.update(names)
            warnings.warn(f"KFACPreconditioner: registered layer(s) {names} have gradients but no forward of them was "
                          "recorded (their weight is used without calling the module, e.g. F.linear(x, layer.weight), "
                          "or they ran in eval mode or under no_grad): their factors do not update (without factors "
                          "yet, their gradients stay unpreconditioned); call the module itself in training mode, or "
                          "add them to skip_layers",
                          UserWarning, stacklevel=caller_stacklevel())

    @torch.no_grad()
    def step(self) -> None:
        """Precondition the gradients of the registered layers in place (then call ``optimizer.step()``).

        Gradients must already be averaged over ranks (``DistributedDataParallel`` does it in
        ``backward``). Every rank must call it. A NaN/inf gradient, factor or decomposition makes
        the step a no-op (``on_nonfinite``; then ``last_step_skipped`` is True: skip
        ``optimizer.step()``).
        """
        layers = list(self.layers.values())
        settle = self.__dict__.pop("_settle_pending", None)
        attach = self.__dict__.pop("_attach_pending", False)
        unrecorded = settle is not None or attach
        if unrecorded:  # copied or unpickled as an attribute of its own model, not built then: attached now
            if settle is not None:
                self._settle_copy(*settle)
            else:
                self._attach_hooks()
            self._forget_step(layers)  # (a step half recorded when the copy was taken: not this model's)
            factors = any(layer.has_factors() for layer in layers)
            warnings.warn("KFACPreconditioner: copied or unpickled as part of the model it preconditions (an attribute "
                          "of it), its hooks are attached at this first step(): the forward and backward before it were "
                          "not recorded, so this step " + ("preconditions with the copied factors without updating "
                                                           "them" if factors else "leaves the gradients as they are"),
                          UserWarning, stacklevel=caller_stacklevel())
            if not factors:
                return
        if not self._attached_checked:
            self._attached_checked = True
            warn_if_attached(layers, self)
        if not self._sync_warned:
            self._sync_warned = warn_if_not_sync_step()
        # every schedule this step reads, evaluated (and checked) before anything changes: a callable
        # returning NaN raises with the gradients untouched and the factors as at the last step (the
        # batches the backward hooks folded are taken out again)
        try:
            factor_step = self._steps % self.factor_update_steps == 0 and not unrecorded
            inverse_step = self._steps % self.inv_update_steps == 0
            decay = self.factor_decay if factor_step else None
            damping = self.damping
            kl_clip = self.kl_clip
            lr = self.lr if kl_clip is not None else None
        except BaseException:
            self._forget_step(layers)
            raise
        undo: Dict[str, Any] = {}
        try:
            self._precondition(layers, factor_step, inverse_step, decay, damping, kl_clip, lr, undo)
        except BaseException as err:
            # an error, or Ctrl-C in a decomposition: the factors, decompositions and counts as at the last step
            # (gradients already preconditioned stay so: zero them before the next backward)
            self._forget_step(layers)
            if undo.get("previous") is not None:
                restore_decompositions(layers, undo["previous"])
            # sharded after it was built: torch's "mixed torch.Tensor and DTensor", a shape error
            failure = sharded_failure(err, self._model, "KFACPreconditioner")
            if failure is not None:
                raise failure from err
            raise

    def abandon_step(self) -> None:
        """Undo what the hooks recorded and folded since the last :meth:`step`: the factors the backward
        hooks updated, the micro-batches and the counted calls. Call it when an iteration is abandoned
        between its forward/backward and ``step()`` (an exception or Ctrl-C in the training loop, a batch
        skipped after its backward), so that the next iteration folds as if it had not run (``step()`` does
        this itself when it raises). :meth:`reset_batch` keeps kfac_pytorch's meaning (the batches not yet
        folded only)."""
        self._forget_step(list(self.layers.values()))

    def _precondition(self, layers: List[KFACLayer], factor_step: bool, inverse_step: bool, decay: Optional[float],
                      damping: float, kl_clip: Optional[float], lr: Optional[float], undo: Dict[str, Any]) -> None:
        """The body of :meth:`step` once its schedules are read; ``undo["previous"]`` holds the decompositions
        before this step's inverse update, for :meth:`step` to put back if this raises."""
        if factor_step and layers and not any(layer.has_factors() for layer in layers) \
                and (not any(self._mini_steps.values()) or not any(layer.has_grad() for layer in layers)):
            # no recorded forward, or no gradient, before the first factors: kfac_pytorch raises here too
            # ("Cannot eigendecompose A before A has been computed"); a silent no-op would count the step
            what = ("no forward of a registered layer was recorded before step()" if not any(self._mini_steps.values())
                    else "no registered layer has a gradient at the first step()")
            self._forget_step(layers)
            raise RuntimeError(compiled_before_hooks(what, "the preconditioner", uncompiled=False)
                               if self._model_is_compiled else
                               f"{what}, so there are no factors to precondition with: run the model's forward (with "
                               "gradients, in training mode) and backward before step() (a registered layer never "
                               "called, as nn.MultiheadAttention's out_proj, whose weight the attention uses directly, "
                               "needs skip_layers). If the loop calls a torch.compile'd copy of the model, its graph "
                               "was traced before the preconditioner's hooks existed: "
                               + compile_advice("the preconditioner"))
        self._warn_scaled_gradients()
        removed = self._check_model_unchanged(layers) if factor_step else set()
        if decay is not None:
            # every batch of the step, or (factors updated in the hooks) those no hook folded
            # (_fold_in_hook: e.g. fewer micro-batches than accumulation_steps)
            for layer in layers:
                if (not self.update_factors_in_hook or layer.batch_count) and layer.update_factors(decay):
                    self._updated.add(layer.name)
        # the ranks agree on which layers were updated (on any rank) before their factors travel
        updated = self._kaisa.allreduce_factors(layers, self._updated) if factor_step else set(self._updated)
        if factor_step:
            self._warn_unrecorded(layers, updated | removed)
        self._warn_factorless(layers, factor_step)
        if self._skip_nonfinite(layers, nonfinite_entries(layers, updated, self.grad_scaler is None)):
            return
        self._updated.clear()

        previous = None
        if inverse_step:
            previous = undo["previous"] = decompositions_before(layers)
            for layer in layers:
                if layer.has_factors():
                    self._kaisa.compute_and_share_inverses(layer, damping)

        active = [layer for layer in layers if layer.inv_ready and layer.has_grad()]
        if self.grad_scaler is not None and not all(
                bool(torch.isfinite(p.grad).all()) for layer in active for p in layer.params):
            logger.warning("K-FAC step %d: non-finite gradients (AMP overflow), gradients left unpreconditioned",
                           self._steps)
            active = []
        results: List[Tuple[KFACLayer, Tensor, Tensor]] = []
        for layer in active:
            grad = layer.grad_matrix()
            if self._kaisa.is_grad_worker(layer):
                precond = layer.precondition(grad, damping)
            else:
                precond = torch.empty_like(grad)
            self._kaisa.share_gradient(layer, precond)
            results.append((layer, precond, grad))
        if self._skip_nonfinite(layers, nonfinite_results(results), previous):
            return
        scale = None if kl_clip is None else kl_clip_scale([(p, g) for _, p, g in results], lr, kl_clip)
        for layer, precond, _ in results:
            layer.set_grad(precond, scale)
        for layer in layers:
            layer.keep_folds()
        self._skips.passed()
        self._steps += 1
        self._reset_step_counts()

    def _skip_nonfinite(self, layers: List[KFACLayer], entries: List[str],
                        previous: Optional[Dict[str, Any]] = None) -> bool:
        """On non-finite ``entries`` put the factors (and the ``previous`` decompositions) back,
        drop the batches and apply ``on_nonfinite`` (see :mod:`.nonfinite`); False if none."""
        if not entries:
            return False
        self._forget_step(layers)
        if previous is not None:
            restore_decompositions(layers, previous)
        self._skips.skipped(self._steps, entries)
        return True

    def _forget_step(self, layers: List[KFACLayer]) -> None:
        """Put the factors back as at the last step (the batches the hooks folded taken out) and drop this
        step's batches and recorded calls."""
        for layer in layers:
            layer.undo_folds()
        self._updated.clear()
        self._reset_step_counts()

    # ---- the non-finite policy's settings and counters (torchsso2/kfac/nonfinite.py) ----------------
    @property
    def on_nonfinite(self) -> str:
        return self._skips.on_nonfinite

    @property
    def max_consecutive_skips(self) -> Optional[int]:
        return self._skips.max_consecutive_skips

    @property
    def num_skipped(self) -> int:
        """Steps skipped so far because of a non-finite gradient, factor or decomposition."""
        return self._skips.num_skipped

    @property
    def consecutive_skips(self) -> int:
        """Skipped steps since the last step that went through."""
        return self._skips.consecutive_skips

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last :meth:`step` was skipped (its gradients are the raw, non-finite ones)."""
        return self._skips.last_skipped

    def reset_batch(self) -> None:
        """Drop the factor batches collected since the last update."""
        for layer in self.layers.values():
            layer.reset_batch()

    # ---- state ------------------------------------------------------------------------------------
    def state_dict(self, include_factors: bool = True, include_decompositions: bool = True) -> Dict[str, Any]:
        """kfac_pytorch's state (``steps``, the non-callable hyper-parameters, optionally the
        factors ``layers``) plus, with ``include_decompositions``, the key ``"torchsso2"``: the
        decompositions this rank holds (with the factors) and the non-finite counters (format:
        :mod:`torchsso2.kfac.state`; ``include_decompositions=False`` gives exactly kfac_pytorch's
        keys). The tensors are the preconditioner's own (``torch.save`` them); with the
        decompositions a resumed run is bit-identical."""
        include_factors = parse_flag("include_factors", include_factors)  # 0/1 too, as the constructor's flags
        include_decompositions = parse_flag("include_decompositions", include_decompositions)
        state: Dict[str, Any] = {"steps": self._steps}
        for name in HYPERPARAMS:
            value = getattr(self, f"_{name}")
            if not callable(value):
                state[name] = value
        if include_factors:
            state["layers"] = layers_state(list(self.layers.values()))
        if include_decompositions:  # our extension of kfac_pytorch's format, under one key
            ext: Dict[str, Any] = {"num_skipped": self._skips.num_skipped,
                                   "consecutive_skips": self._skips.consecutive_skips}
            if include_factors:
                ext["decompositions"], ext["inv_ready"] = decompositions_state(list(self.layers.values()))
                first = next(iter(self.layers.values()), None)
                ext["placement"] = {"world_size": self.comm.world_size,
                                    "grad_workers": {n: list(self.assignment.grad_workers(n)) for n in self.layers},
                                    "decomposition": first.decomposition_kind if first else []}
            state[EXTENSION] = ext
        return state

    def _moved_layers(self, placement: Optional[Tuple[int, Dict[str, Tuple[int, ...]]]]) -> Set[str]:
        """The layers whose grad workers now differ from a checkpoint's ``placement`` (all of them when the world
        size differs; none when the checkpoint does not record it)."""
        if placement is None:
            return set()
        world, saved = placement
        if world != self.comm.world_size:
            return set(self.layers)
        return {n for n in self.layers if tuple(saved.get(n, ())) != tuple(self.assignment.grad_workers(n))}

    def load_state_dict(self, state_dict: Dict[str, Any], compute_inverses: bool = True) -> None:
        """Restore :meth:`state_dict` (ours or kfac_pytorch's).

        The whole state dict is validated against the registered layers first (names, keys,
        shapes, dtypes, finiteness, hyper-parameter values; :func:`~torchsso2.kfac.state.validate_state`);
        a bad one raises ``ValueError`` naming the entry and leaves the preconditioner unchanged.
        Decompositions in the state dict are used as they are; without them (kfac_pytorch's
        format) ``compute_inverses`` recomputes them from the loaded factors (every rank must
        call it then). A layer listed as decomposed whose decompositions this rank needs but the
        state dict lacks (a checkpoint from a rank that did not hold them) is decomposed here, and so is
        every layer whose grad workers differ from those of the saving world (another number of ranks or
        another ``grad_worker_fraction``: elastic training), so that the ranks precondition alike
        whichever rank's file each loaded. On the same ranks and placement, load each rank's own file or
        one file on every rank (docs/kfac.md, "Checkpoints").
        """
        compute_inverses = parse_flag("compute_inverses", compute_inverses)
        staged = validate_state(state_dict, list(self.layers.values()), self.factor_dtype, self.inv_dtype)
        # from here on nothing can fail before the state is consistent again
        self._steps = staged.steps
        for name, value in staged.hyperparams.items():
            setattr(self, f"_{name}", value)
        self._skips.num_skipped = staged.counters.get("num_skipped", 0)
        self._skips.consecutive_skips = staged.counters.get("consecutive_skips", 0)
        self._skips.last_skipped = False
        for layer in self.layers.values():
            layer.reset_batch()
            layer.keep_folds()
            if staged.factors is not None:
                layer.a_factor, layer.g_factor = staged.factors[layer.name]
        self._reset_step_counts()
        self._updated.clear()
        if staged.decompositions is not None:
            moved = self._moved_layers(staged.placement)
            for layer in self.layers.values():
                worker = self._kaisa.is_grad_worker(layer)  # only grad workers keep decompositions
                # a layer whose grad workers changed (another world size or strategy) is decomposed anew from the
                # factors by each of them: they may have loaded different ranks' files, some without it
                layer.inv = dict(staged.decompositions.get(layer.name, {})) if worker and layer.name not in moved \
                    else {}
                layer.inv_ready = layer.name in staged.inv_ready
                if layer.inv_ready and not layer.inv and worker:
                    layer.compute("A", self.damping)  # local: this rank's grad-worker share, no collective
                    layer.compute("G", self.damping)
            return
        if staged.factors is None and compute_inverses:
            warnings.warn("Layer factors are not included in the state_dict so inverses cannot be computed; "
                          "skipping inverse computation", stacklevel=2)
        elif compute_inverses:
            damping = self.damping
            for layer in self.layers.values():
                if layer.has_factors():
                    self._kaisa.compute_and_share_inverses(layer, damping)
        elif staged.factors is not None and any(layer.has_factors() for layer in self.layers.values()):
            # kfac_pytorch's step() raises here; ours passes the gradients through, so say so once
            warnings.warn("load_state_dict(compute_inverses=False) of a state_dict with factors but no "
                          "decompositions: until the next inverse step the layers precondition with the "
                          "decompositions they had before the load (a new preconditioner has none: plain "
                          "gradients, no KL clip), not with the loaded factors; pass compute_inverses=True to "
                          "decompose the loaded factors now", stacklevel=2)


def _NONE() -> None:
    """What a weak reference to a parameter gone from its module gives (:meth:`KFACPreconditioner._remember_parameters`)."""
    return None


def _held_now(layer: KFACLayer) -> Tuple[Optional[nn.Parameter], ...]:
    """``layer``'s covered parameter objects as its module holds them now (None: gone)."""
    return tuple(layer.module._parameters.get(n) for n in layer.param_names)
