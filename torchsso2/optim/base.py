"""Machinery shared by the natural-gradient and the VI optimizer (one engine, several faces).

:class:`CurvatureOptimizer` is a ``torch.optim.Optimizer`` that owns

* a :class:`curvature.CurvatureEngine` (capture + estimation),
* a :class:`curvature.RunningCurvature` (EMA of the blocks and their decompositions),
* a seeded ``torch.Generator`` for label/weight sampling (saved in ``state_dict``),
* a :class:`torchsso2.distributed.Communicator` averaging gradients and curvature over ranks,
* the non-finite policy (``on_nonfinite="skip" | "raise"``).

Subclasses implement ``step`` by composing the small functions of :mod:`torchsso2.optim.steps`.
"""
from __future__ import annotations

from collections import OrderedDict
import logging
import math
import numbers
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from curvature import CurvatureEngine, RunningCurvature
from curvature.engine import compile_advice
from curvature.running import decompose_block
from curvature.blocks import Block, DiagBlock, FullBlock, KFACBlock
from curvature.blocks.base import all_finite, owned_all_finite
from curvature.linalg import LinalgError
from curvature.linalg.checks import refuse_sparse
from curvature import likelihoods
from curvature.hook_marks import warn_if_attached
from curvature.options import Kind, LossType
from curvature.root_calls import NestedCalls
from curvature.uses_static import observer_hook

from ..distributed import Communicator, get_communicator
from ..distributed.consistency import check_optimizer_settings, groups_digest, sizes_row
from .grid import agree_on_start, rank_seed  # [issue #7: distributed]
from .placement import Placement  # [issue #7: distributed]
from .messages import decomposition_failed
from .plan import PlanCache, ScalarCache, UpdatePlan, params_with_grad, warn_partly_frozen
from .accelerate_checks import warn_if_accelerate_accumulates
from .accumulation import (ACCUMULATION_NEEDS_TARGETS, HESSIAN_NEEDS_TARGETS, MicroBatchTargets,
                           is_second_forward_reuse)
from .precision import without_autocast
from .misuse import ClosureWatch, check_model_argument, warn_blockless_modules
from .output_consumers import warn_if_output_meets_foreign_weights
from .used_forwards import UsedForwards
from .checkpoint import check_blocks
from .checkpointing import CheckpointState
from .copying import copy_fields
from .ddp_sync import DDPSync, fingerprint
from .late_groups import warn_params_gone, warn_uncovered_layers, warn_unfrozen
from .param_groups import GroupChecks, listed_groups, refuse_sparse_gradients
from .reporting import worth_reporting
from .routing import fill_absent, fold, presence, scale_to_whole_batch, unweigh_inputs, weigh_inputs
from .settings import CurvatureSettings
from .skips import NonFiniteError, SkipStreak, StepUndo, diagnose
from .closure_output import call_closure
from .validation import check_int, check_nonempty_batch

logger = logging.getLogger(__name__)

#: ``step``'s argument: a closure returning the loss, or ``(loss, output)`` (:mod:`.closure_output`)
Closure = Callable[[], Union[Tensor, float, Tuple[Tensor, Any]]]
_BLOCK_TYPES = {"full": FullBlock, "diag": DiagBlock, "kfac": KFACBlock}


class BlockAverage:
    """Weighted average of fresh blocks: the micro-batches of one closure (weights = batch sizes)
    or the MC weight samples of one VI step (equal weights). ``nonfinite`` marks a batch whose
    output was not finite; :meth:`result` then returns ``{}`` (the step applies the policy).
    A module some of them did not call counts as zeros there (:mod:`torchsso2.optim.routing`)."""

    def __init__(self) -> None:
        self.blocks: Optional[Dict[str, Block]] = None
        #: per block, the weight it has collected (a module a micro-batch did not call is left out of
        #: that micro-batch's blocks, and averaged over the others until :meth:`result`)
        self.counts: Dict[str, int] = {}
        self.total = 0  # the weight of every micro-batch added
        self.nonfinite = False

    def add(self, blocks: Dict[str, Block], n: int) -> None:
        self.total += n
        if self.blocks is None:
            self.blocks, self.counts = dict(blocks), {name: n for name in blocks}
            return
        for name, new in blocks.items():
            if name not in self.blocks:
                self.blocks[name], self.counts[name] = new, n
                continue
            fold(self.blocks[name], new, self.counts[name], n)
            self.counts[name] += n

    def result(self) -> Dict[str, Block]:
        if self.nonfinite:
            return {}
        assert self.blocks is not None
        for name, count in self.counts.items():  # zeros from the micro-batches that did not call a module
            if count < self.total:
                scale_to_whole_batch(self.blocks[name], count / self.total)
                self.counts[name] = self.total
        return self.blocks


#: instance attributes a deep copy does not take over (torch.optim's copies drop them too): the
#: optimizer hooks, and the ``step`` wrapper an LR scheduler installs (it calls the original optimizer)
_NOT_COPIED = frozenset({"step", "_opt_called", "_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                         "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                         "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"})


def loss_is_finite(loss: Any) -> bool:
    """Whether a closure's loss is finite: a tensor through :func:`all_finite` (it is in the user's graph), a
    number (a closure may return ``loss.item()``) by :func:`math.isfinite`; anything else counts as finite."""
    if isinstance(loss, Tensor):
        return all_finite([loss])
    return not isinstance(loss, numbers.Real) or math.isfinite(float(loss))


class CurvatureOptimizer(GroupChecks, CheckpointState, torch.optim.Optimizer):
    """Base class; see :class:`SecondOrderOptimizer` and :class:`VIOptimizer`."""

    def __init__(self, model: nn.Module, params: Optional[Iterable[Any]], defaults: Dict[str, Any],
                 settings: CurvatureSettings) -> None:
        check_model_argument(model, type(self).__name__)
        if getattr(model.forward, "__func__", None) is nn.Module.forward and not self.__dict__.get("reparam", False):
            # (the instance's forward: torch.compile's OptimizedModule sets its own on the instance)
            # (VIOptimizer's default diagonal needs the gradients only, not the model's forward)
            raise TypeError(f"{type(self).__name__} records the forward of the model it is given, and "
                            f"{type(model).__name__} has no forward() (a container such as nn.ModuleList or "
                            "nn.ModuleDict cannot be called): give it the module whose forward the closure calls")
        self.settings = settings
        self.model = model
        include = None
        if params is not None:  # only the optimizer's own parameters get curvature (and, VI, weight noise)
            params = listed_groups(params)
            include = {id(p) for g in params for p in (g["params"] if isinstance(g, dict) else [g])}
            if not include:  # torch.optim's message (an empty list, a consumed generator, only empty groups),
                raise ValueError("optimizer got an empty parameter list")  # not "no supported layer"
            if include.isdisjoint(id(p) for p in model.parameters()):
                raise ValueError(f"none of the {len(include)} parameters in params belongs to the model the "
                                 f"{type(self).__name__} was built on; pass parameters of that model "
                                 "(model.parameters(), or a subset of them), or build it on the model that holds them")
        self.engine = CurvatureEngine(model, kind=settings.curvature, approx=settings.approx, loss=settings.loss,
                                      mc_samples=settings.mc_samples, skip_modules=settings.skip_modules,
                                      output_selector=settings.output_selector, kfac_approx=settings.kfac_approx,
                                      include=include, any_module=settings.any_module)
        self.ema_decay = settings.ema_decay
        self.curv_update_interval = settings.curv_update_interval
        self.inv_update_interval = settings.inv_update_interval
        self.on_nonfinite = settings.on_nonfinite
        self.linalg = settings.linalg
        self.grad_scaler = settings.grad_scaler
        self.num_amp_skipped = 0
        self.decomposition_dtype = settings.decomposition_dtype
        communicator, seed = settings.communicator, settings.seed
        implicit = params is None
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, defaults)
        #: the model's parameters when it was built (late_groups.warn_params_gone: which have left it since)
        self._params_in_model = {id(p) for p in model.parameters()}
        refuse_sparse_gradients(model, self.param_groups)
        # a Fisher-type kind's blocks are positive semi-definite: a full block's negative eigenvalues are round-off
        self.running = RunningCurvature(psd=self.engine.kind is not Kind.HESSIAN)
        #: how K-FAC blocks are decomposed: "eigen" (exact damping) or "inverse" (factored; SecondOrderOptimizer)
        self.__dict__.setdefault("kfac_method", "eigen")
        self._plans = PlanCache()      # per-step bookkeeping of the update (torchsso2/optim/plan.py)
        self._scalars = ScalarCache()  # hyperparameters as cached 0-dim tensors for foreach ops
        if not isinstance(communicator, (str, type(None), Communicator)):
            raise TypeError(f"communicator must be a backend name ('auto', 'none', 'torch', 'mpi') or a Communicator, "
                            f"got {type(communicator).__name__} {communicator!r}")
        self.comm = communicator if not isinstance(communicator, (str, type(None))) else \
            get_communicator("auto" if communicator is None else communicator)  # "" is refused there
        # [issue #7: distributed] KAISA placement of the decompositions (torchsso2/optim/placement.py);
        # all ranks start from rank 0's weights and seed; label sampling is decorrelated per rank
        # (rank 0 keeps `seed`, so one process is unchanged).
        self.placement = Placement(self.comm, settings.grad_worker_fraction, settings.assignment_strategy)
        # a covered module a forward did not call (a head other batches use) keeps its curvature for that step;
        # with several processes, the ranks that called it average their blocks with zeros from the others
        # (torchsso2/optim/routing.py)
        self.engine.allow_uncalled = True
        check_optimizer_settings(self)  # every rank built with the same schedule, before any collective
        if seed is not None:
            check_int("seed", seed, low=0, high=2 ** 63 - 1)
        # seed=None: one draw of torch's global generator, as a DataLoader's base seed (torch.initial_seed() gave
        # every optimizer built after one torch.manual_seed the same stream: an ensemble's members shared noise)
        self.seed = agree_on_start(self.comm, model, int(seed) if seed is not None
                                   else int(torch.randint(0, 2 ** 62, (), dtype=torch.int64)))
        self.generator = torch.Generator()
        self.generator.manual_seed(rank_seed(self.seed, self.comm.rank))
        # [end issue #7]
        self.num_steps = 0
        self.num_skipped = 0
        self._streak = SkipStreak(settings.max_consecutive_skips)  # consecutive skipped steps (torchsso2/optim/skips.py)
        self._undo = StepUndo(model)  # what a skipped step gives back
        self._covered_at_start = list(self.engine.params)  # the covered parameters at construction
        # parameters frozen at construction, in the param groups (params=[...] listed them) or, built on the
        # model's trainable parameters, left out of them: a warning when one is unfrozen (.late_groups)
        self._frozen_in_groups = [p for g in self.param_groups for p in g["params"] if not p.requires_grad]
        self._frozen_outside = [p for p in model.parameters() if not p.requires_grad] if implicit else []
        self._decomposed = False
        #: the decompositions are of an earlier damping (:meth:`SecondOrderOptimizer._set_damping`): the next step
        #: decomposes again, and keeps them where that fails
        self._redamp_pending = False
        #: several processes: the optimizer averages the gradients itself unless a DDP wrapper did (its own
        #: model's wrapper too: a parameter DDP does not sync, frozen when DDP was built and trainable now,
        #: had gone unaveraged and the replicas drifted apart): whether one did, per step (ddp_sync.py)
        built_on_ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        inner = model.module if built_on_ddp else model
        # built on the wrapper, the model always runs inside it: the fingerprints are compared when the set of
        # parameters with gradients changes (a layer unfrozen), not at every step (DDPSync.verified)
        self._ddp_sync = DDPSync(inner, self.comm.world_size, recheck_on_change_only=built_on_ddp) \
            if self.comm.world_size > 1 else None

    def __deepcopy__(self, memo: Dict[int, Any]) -> "CurvatureOptimizer":
        """``copy.deepcopy(opt)``: an independent optimizer with everything copied — its model
        (``copy.model``, a deep copy of ``opt.model``), parameters, state, curvature, counters and
        random streams — so both continue identically. Copy the model and the optimizer together
        (``model2, opt2 = copy.deepcopy((model, opt))``) to get ``opt2.model is model2``. Not
        supported with several processes (a communicator cannot be copied): ``TypeError``."""
        # as torch.optim's copies: no hooks, no scheduler's wrapper of step
        new = copy_fields(self, memo, "an optimizer", "a new optimizer", "opt", _NOT_COPIED.__contains__)
        for key in _NOT_COPIED.intersection(self.__dict__):
            if key.endswith("_hooks"):
                new.__dict__[key] = OrderedDict()
        # (ids of parameters: the copy's are other objects)
        new._params_in_model = {id(p) for p in new.model.parameters()}
        new.__dict__.pop("_gone_checked", None)
        return new

    def _check_step_call(self, closure: Any) -> None:
        """:meth:`GroupChecks._check_step_call`, and a step begins for the DDP check (:mod:`.ddp_sync`)."""
        super()._check_step_call(closure)
        self._skip_counted = False  # num_skipped counts a step call once, whatever failed in it
        if "_accelerate_checked" not in self.__dict__:  # accelerate's accumulation skips steps (accelerate_checks.py)
            self._accelerate_checked = True
            warn_if_accelerate_accumulates(type(self).__name__)
        if self.grad_scaler is not None and self._grads_unscaled():  # its last step's unscale_ still stands
            raise RuntimeError(
                f"{type(self).__name__}.step() called again without scaler.update() since the last step: the "
                "grad_scaler would leave this step's gradients scaled (torch's GradScaler.step raises here too); "
                "call scaler.update() after every step()")
        if self.__dict__.get("_ddp_sync") is not None:
            self._ddp_sync.begin_step()

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """As :meth:`GroupChecks.add_param_group`; after construction, a group holding parameters of
        layers with curvature support that are not covered is a UserWarning (:mod:`.late_groups`)."""
        super().add_param_group(param_group)
        if "running" in self.__dict__:  # built: a group added later (the constructor's pass here first)
            warn_uncovered_layers(self, self.param_groups[-1]["params"])
            # (the model's parameters among them: late_groups.warn_params_gone says when they leave it)
            own = {id(p) for p in self.model.parameters()}
            self._params_in_model.update(id(p) for p in self.param_groups[-1]["params"] if id(p) in own)

    def _warn_unfrozen(self) -> None:
        """Warn once about parameters frozen at construction that are trainable now (:mod:`.late_groups`):
        those in the param groups take the plain update; those left out of them, unless added since
        (``add_param_group`` warned then), are not updated at all."""
        if any(p.requires_grad for p in self._frozen_in_groups):
            thawed = [p for p in self._frozen_in_groups if p.requires_grad]
            self._frozen_in_groups = [p for p in self._frozen_in_groups if not p.requires_grad]
            warn_unfrozen(self, thawed, in_groups=True)
        if any(p.requires_grad for p in self._frozen_outside):
            own = {id(p) for g in self.param_groups for p in g["params"]}
            thawed = [p for p in self._frozen_outside if p.requires_grad and id(p) not in own]
            self._frozen_outside = [p for p in self._frozen_outside if not p.requires_grad]
            if thawed:
                warn_unfrozen(self, thawed, in_groups=False)

    def __getstate__(self) -> Dict[str, Any]:
        raise TypeError(f"{type(self).__name__} cannot be pickled as an object (its curvature engine holds hooks "
                        "on the model); save opt.state_dict() with torch.save and load it into a new optimizer "
                        "with load_state_dict, or copy.deepcopy((model, opt)) within one process")

    # ---- capture + estimate -------------------------------------------------------------
    def _call_closure(self, closure: Closure) -> Tuple[Any, Any]:
        """``(loss, output)`` of one call of ``closure``, which returns either or the loss alone
        (:mod:`.closure_output`; the output is then the model's at the first call and where the previous
        call returned the loss alone, else None). Which form it returned shapes what ``step`` returns
        (:meth:`_step_result`)."""
        sync = self.__dict__.get("_ddp_sync")
        handle = sync.watch() if sync is not None else None
        completed = False
        try:
            loss, output, self._loss_only = call_closure(closure, self.model, self.__dict__.get("_loss_only", True))
            completed = True
        finally:
            if handle is not None:
                handle.remove()
                sync.end_call(completed)
        return loss, output

    def _step_result(self, loss: Any, output: Any) -> Any:
        """What ``step`` returns: the loss if the closure returned the loss alone, else ``(loss, output)``."""
        return loss if self.__dict__.get("_loss_only", False) else (loss, output)

    def _run_closure(self, closure: Closure, targets: Optional[Tensor], estimate: bool
                     ) -> Tuple[Tensor, Tensor, Optional[Dict[str, Block]]]:
        """Run the closure once; when ``estimate``, also estimate this batch's curvature. The step checked
        the call first (:meth:`_check_step_call`)."""
        if self._frozen_in_groups or self._frozen_outside:
            self._warn_unfrozen()
        if "_attached_checked" not in self.__dict__:  # (at the first closure call, estimating or not: VI's diagonal)
            self._attached_checked = True
            # a KFACPreconditioner on the same layers: stepping both preconditions them twice (the curvature's own
            # passes are hidden from it, curvature.hook_marks.HiddenPasses; docs/kfac.md)
            warn_if_attached(self.engine.layouts.values(), self)
        trainable = self._trainable_modules() if estimate else None
        if trainable == []:  # every covered module frozen (a plain group trains alone): no estimate, the
            if not self.running.blocks:  # running curvature is kept; without one there is nothing to keep
                raise ValueError(
                    "every covered module is frozen (requires_grad=False) and no curvature has been estimated "
                    "yet: take a step with them trainable first (a frozen module keeps its curvature), or build "
                    "the optimizer on the parameters that train (params=...)")
            estimate = False
        misuse = self.__dict__.setdefault("_misuse", {})
        if not estimate and not ClosureWatch.watching(misuse):  # the watch is over: nothing to set up
            with torch.enable_grad():
                loss, output = self._call_closure(closure)
            self._check_nonempty(output)
            return loss, output, None
        if estimate and self.engine.kind is Kind.HESSIAN and targets is None:  # (before the watch takes a check)
            raise ValueError(HESSIAN_NEEDS_TARGETS)
        watch = ClosureWatch(self.param_groups, self._categorical_use(targets), misuse, estimate,
                             check_scale=self.engine.loss is LossType.CROSS_ENTROPY and self.grad_scaler is None,
                             keep_output_grads=self._keeps_output_grads(targets),
                             rows_counted=self._rows_counted(targets))
        if not estimate:  # no capture: while outputs are still checked, a forward hook shows them to the watch
            micro = MicroBatchTargets(targets)  # each forward's rows (gradient accumulation)
            # the output is checked as an estimating call checks it, except where nothing reads its likelihood (the
            # empirical Fisher from the user's backward, no prediction: a one-logit model's own loss is fine there)
            from_backward, predicts = self._output_use(targets) if watch.active else (True, False)
            shapes = watch.active and (targets is not None or predicts or not from_backward)

            def show(_m: nn.Module, _i: Any, raw: Any) -> None:
                out = raw if self.engine.output_selector is None else self.engine.output_selector(raw)
                # (a forward whose output takes no gradient, a metric under no_grad, is no batch of the loss)
                if shapes and isinstance(out, Tensor) and out.requires_grad:
                    rows = None
                    if targets is not None and out.dim() > 0:
                        try:
                            rows = micro.next(out.shape[0])
                        except ValueError:  # rows this plain step cannot attribute: an estimating step says so
                            rows = None
                    # checked as an estimating call checks them, before the step has changed anything (without
                    # targets, the output alone: VIOptimizer's default diagonal estimates nothing from it, and
                    # one logit under loss='cross_entropy' would fail only at predict())
                    likelihoods.check_outputs_targets(self.engine.loss, out, rows)
                watch.observe_output(out, raw, self.engine.output_selector)
            # the model's calls only, not a wrapper's around them (curvature/root_calls.py)
            hooks = NestedCalls().register(self.model, observer_hook(show)) \
                if watch.check_output or watch.check_scale or shapes \
                or (watch.active and not misuse.get("consumers_checked", False)) else []
            try:
                with torch.enable_grad(), watch:
                    loss, output = self._call_closure(closure)
            finally:
                for hook in hooks:
                    hook.remove()
            with watch.finishing():
                self._check_nonempty(output)
                self._check_output_consumers(watch, loss, targets)
            watch.after()
            return loss, output, None
        engine = self.engine
        if trainable is None:
            return self._estimating_call(closure, targets, watch)
        # modules frozen since construction are left out of the capture and the estimate (their running
        # curvature is kept): a frozen backbone may run under torch.no_grad, and the Hessian cannot
        # differentiate with respect to parameters that do not require a gradient
        with engine.restricted_to(trainable):
            return self._estimating_call(closure, targets, watch)

    def _trainable_modules(self) -> Optional[List[str]]:
        """The covered modules with a covered parameter that requires a gradient, when some module has none
        (None: nothing frozen). A module frozen in part under ``curvature="hessian"`` is a ValueError."""
        if all(p.requires_grad for p in self._covered_at_start):  # the common case: nothing frozen
            return None
        layouts = self.engine.layouts
        frozen = self._frozen_modules()
        trainable = [n for n in layouts if n not in frozen]
        if self.engine.kind is Kind.HESSIAN:
            for n in trainable:
                part = [f"{n}.{q}" for q, p in zip(layouts[n].param_names, layouts[n].params) if not p.requires_grad]
                if part:
                    raise ValueError(
                        f"curvature='hessian' differentiates the loss with respect to every covered parameter of "
                        f"module {n!r}, and {part} do not require a gradient: freeze the whole module "
                        "(requires_grad_(False) on all its parameters: it then keeps its curvature) or none of it")
        return trainable if frozen else None

    def _estimating_call(self, closure: Closure, targets: Optional[Tensor], watch: ClosureWatch
                         ) -> Tuple[Tensor, Tensor, Optional[Dict[str, Block]]]:
        """:meth:`_run_closure`'s call of the closure that estimates the batch's curvature."""
        engine = self.engine
        from_backward = engine.kind is Kind.EMPIRICAL_FISHER and targets is None
        acc = BlockAverage()
        used = UsedForwards(acc)  # the forwards whose output the closure's backward reaches (used_forwards.py)
        micro = MicroBatchTargets(targets)  # each forward's rows of targets (torchsso2/optim/accumulation.py)

        def on_output(out: Tensor) -> None:
            # called after every forward of the model inside the closure: a closure may run
            # several micro-batches (gradient accumulation); their curvature is averaged
            # weighted by the rows each loss averages over (N, or N·T tokens for [N, T, C] logits),
            # so K micro-batches of B equal one batch of K·B.
            check_nonempty_batch(out)
            if from_backward:
                watch.observe_output(out, cap.raw_outputs[-1], engine.output_selector)
                return
            rows = micro.next(out.shape[0])
            blocks = None
            if likelihoods.outputs_finite(engine.loss, out):  # (-inf logits of masked classes are finite)
                with without_autocast():  # statistics in float32 from the autocast activations
                    blocks = engine.estimate(cap, out, rows, self.generator)
            # after the engine's own backward passes: the hooks see the user's only
            used.add(blocks, likelihoods.loss_rows(engine.loss, out), (cap.raw_outputs[-1], out))
            watch.observe_output(out, cap.raw_outputs[-1], engine.output_selector)
            cap.records.clear()

        with torch.enable_grad(), watch, engine.capture(on_output=on_output, record_backward=from_backward) as cap:
            try:
                loss, output = self._call_closure(closure)
            except ValueError as err:
                if from_backward and is_second_forward_reuse(err, len(cap.outputs)):
                    raise ValueError(ACCUMULATION_NEEDS_TARGETS) from err
                raise
            finally:
                used.finish()
        with watch.finishing():
            self._check_output_consumers(watch, loss, targets)
        watch.after()
        micro.finish()
        if from_backward:
            if len(cap.outputs) > 1:
                raise ValueError(ACCUMULATION_NEEDS_TARGETS)
            if cap.outputs:
                n = likelihoods.loss_rows(engine.loss, cap.outputs[0])  # N, or N·T for [N, T, C] logits
                scale = float(self.grad_scaler.get_scale()) if self.grad_scaler is not None else 1.0
                acc.add(engine.estimate_from_backward(cap, loss_scale=n / scale), n)
        if acc.blocks is None and not acc.nonfinite:
            raise RuntimeError("the closure did not run the model's forward; call model(...) inside the closure. If it "
                               "calls a torch.compile'd copy of the model, its graph was traced before the optimizer's "
                               "hooks existed: " + compile_advice("the optimizer"))
        return loss, output, acc.result()  # (frozen modules were left out of the capture: _run_closure)

    def _output_use(self, targets: Optional[Tensor]) -> Tuple[bool, bool]:
        """``(curvature from the user's backward alone, predicts from the output)``: what a model output that
        is not the likelihood's would spoil (:mod:`.output_consumers`). Here: the empirical Fisher from the
        user's backward (no targets, no adaptive quadratic model, which takes the output's NLL); no prediction."""
        adaptive = self.__dict__.get("adaptive")
        from_backward = self.engine.kind is Kind.EMPIRICAL_FISHER and targets is None \
            and (adaptive is None or not (adaptive.learning_rate or adaptive.momentum))
        return from_backward, False

    def _check_output_consumers(self, watch: ClosureWatch, loss: Any, targets: Optional[Tensor]) -> None:
        """Once per optimizer, at the first watched call that saw the model's output: a warning when it reaches
        the loss through weights outside the model (:mod:`.output_consumers`); the softmax check, which would
        say the same less precisely, is then not made."""
        misuse = self.__dict__.setdefault("_misuse", {})
        if watch.first_output is None or misuse.get("consumers_checked", False):
            return
        misuse["consumers_checked"] = True
        from_backward, predicts = self._output_use(targets)
        if (predicts or not from_backward) and warn_if_output_meets_foreign_weights(
                self, loss, watch.first_output, from_backward):
            watch.check_output = False
            misuse["output_checks_left"] = 0

    def _follow_param_dtypes(self) -> None:
        """Momentum buffers follow their parameter's dtype and device, and the running curvature and its
        decompositions the compute dtype of their module's parameters (``model.double()`` or
        ``model.to(device)`` after some steps: as a checkpoint loaded into the converted model gives
        them; the fused momentum kernel needs the buffers to match). Called before the step's closure
        (whose weight noise reads the decompositions); looked at only when the first parameter's dtype
        or device changed (``model.to`` moves all)."""
        first = self.param_groups[0]["params"][0] if self.param_groups and self.param_groups[0]["params"] else None
        key = (first.dtype, first.device) if first is not None else None
        if key == getattr(self, "_params_dtype_key", key):
            self._params_dtype_key = key
            return
        self._params_dtype_key = key
        state = self.state
        for p in (q for g in self.param_groups for q in g["params"]):
            buf = state[p].get("momentum_buffer") if p in state else None
            if buf is not None and (buf.dtype != p.dtype or buf.device != p.device):
                state[p]["momentum_buffer"] = buf.to(dtype=p.dtype, device=p.device)
        if self.running.blocks:
            converted, _ = check_blocks(self, self.running.state_dict())  # the load path's conversion
            self.running.blocks.update(converted)

    def _frozen_modules(self) -> List[str]:
        """The covered modules frozen since construction (``requires_grad_(False)`` on all their covered
        parameters): their running curvature is kept as it was, so unfreezing them later finds it intact."""
        if all(p.requires_grad for p in self._covered_at_start):  # the common case: nothing frozen
            return []
        return [n for n, lay in self.engine.layouts.items() if not any(p.requires_grad for p in lay.params)]

    def _without_frozen(self, fresh: Dict[str, Block]) -> Dict[str, Block]:
        """``fresh`` without the blocks of :meth:`_frozen_modules` (not decayed towards the zero output
        gradients they now get)."""
        frozen = self._frozen_modules()
        return {n: b for n, b in fresh.items() if n not in frozen} if frozen else fresh

    # ---- gradients -------------------------------------------------------------------------
    def _average_over_ranks(self, blocks: Optional[Dict[str, Block]], loss: Optional[Tensor] = None
                            ) -> Tuple[bool, List[nn.Parameter], List[Dict[str, Any]]]:
        """Mean of gradients and fresh curvature over all ranks, in place; returns ``(agreed, params,
        groups)``: the parameters that have a gradient after it, in param-group order, and the group of
        each (one process: the parameters with a gradient, unchanged).

        ``agreed`` is False on every rank when some rank's loss was not finite or its batch was
        marked non-finite (``blocks == {}``); the block all-reduce is then skipped everywhere,
        so all ranks take the same branch of the non-finite policy. (Non-finite gradients
        and statistics need no flag: the mean spreads them to every rank.)
        At a curvature step the flag also carries which covered modules each rank called: a module some
        ranks did not call is averaged with zeros from them (:mod:`torchsso2.optim.routing`).
        """
        params, groups = params_with_grad(self.param_groups)
        warn_params_gone(self, params)
        if self.comm.world_size <= 1:
            return True, params, groups
        bad = (blocks is not None and not blocks) or not loss_is_finite(loss)
        dev = params[0].grad.device if params else \
            next((p.device for p in self.model.parameters()), torch.device("cpu"))
        dtype = params[0].grad.dtype if params else torch.float64
        # the flag's sizes and digests modulo a number whose sum over the ranks the gradients' dtype holds exactly
        # (the mean of equal values is then exact): 2^24 / W in float32, 2^8 / W in bfloat16; W above it: no check
        digits = 1 - int(math.log2(torch.finfo(dtype).eps))  # significand bits: 24 in float32, 8 in bfloat16
        exact = max(1, 2 ** min(digits, 30) // self.comm.world_size)
        settings = [float(d) for d in groups_digest(self.param_groups, exact, self._step_settings())]
        # at a curvature step, which covered modules this rank called (modules some ranks did not call: routing.py)
        order = list(self.engine.layouts) if blocks is not None else []
        riding = settings + (presence(order, blocks) if blocks is not None else [])
        flag, at = None, 1
        if self._ddp_sync is not None and self._ddp_sync.take():  # a DDP wrapper averaged the gradients (ddp_sync.py)
            flag = self._flag_if_ddp_averaged(params, bad, riding, dtype, dev)  # None: the ranks' differ
        if flag is None:
            # every trainable parameter takes part, with zeros where this rank has no gradient (a branch
            # its batch did not take), as DistributedDataParallel does; which ranks had one rides in the
            # flag, so a parameter no rank has a gradient for keeps grad None
            every = [p for g in self.param_groups for p in g["params"] if p.grad is not None or p.requires_grad]
            refuse_sparse([p.grad for p in every if p.grad is not None])  # before the collective flattens them
            lacking = [p.grad is None for p in every]
            mine = [torch.zeros_like(p) if none else p.grad for p, none in zip(every, lacking)]
            numel = sum(p.numel() for p in every)
            size = sizes_row(len(every), numel, exact)
            flag = torch.tensor([1.0 if bad else 0.0] + size + riding + [0.0 if none else 1.0 for none in lacking],
                                dtype=dtype, device=dev)
            # the flag rides first in the gradients' bucket: its sizes line up on every rank even where the
            # ranks' buffers differ (MPI reduces mismatched counts without an error)
            self.comm.allreduce([flag] + mine, op="mean")
            if flag[1:4].tolist() != size:
                raise RuntimeError(
                    f"rank {self.comm.rank} averages gradients of {len(every)} trainable parameters, but the ranks "
                    "hold other numbers or sizes: the ranks disagree on which parameters train "
                    "(requires_grad changed on some ranks only, or param groups added on some); change them on "
                    "every rank alike. The gradients of this step are not usable")
            if any(lacking):  # another rank's branch: this rank's zeros, averaged, where some rank had one
                for p, g, none, share in zip(every, mine, lacking, flag[4 + len(riding):].tolist()):
                    if none and share > 0:
                        p.grad = g
                params, groups = params_with_grad(self.param_groups)
            at = 4
        if flag[at:at + 2].tolist() != settings:
            raise ValueError(
                f"{type(self).__name__}: the param groups' settings (lr, momentum, weight_decay, ...) or the "
                f"attributes set between steps ({', '.join(sorted(self._step_settings()))}) differ between the ranks "
                "at this step (a group added with other values on some ranks, or a learning-rate schedule or "
                "hand-set value that differs): the replicas would drift apart. Set them alike on every rank. The "
                "gradients of this step are not usable")
        if float(flag[0].item()) > 0:
            return False, params, groups
        if blocks:
            # the modules some rank called (a share > 0 in any dtype), in one order on every rank (micro-batches may
            # add a module late), with zeros from the ranks that did not call one
            called = [name for name, share in zip(order, flag[at + 2:at + 2 + len(order)].tolist()) if share > 0]
            fill_absent(blocks, called, self.engine.layouts, self.engine.approx)
            rows = weigh_inputs(blocks)  # K-FAC's A: weighted by the rows each rank's module saw (routing.py)
            sym = [t for b in blocks.values() for t, s in zip(b.tensors(), b.symmetric()) if s]
            rest = [t for b in blocks.values() for t, s in zip(b.tensors(), b.symmetric()) if not s] + rows
            if sym:
                self.comm.allreduce(sym, op="mean", symmetric=True)
            if rest:
                self.comm.allreduce(rest, op="mean")
            unweigh_inputs(blocks, rows)
        return True, params, groups

    def _flag_if_ddp_averaged(self, params: List[nn.Parameter], bad: bool, riding: List[float],
                              dtype: torch.dtype, dev: torch.device) -> Optional[Tensor]:
        """The step's flag ``[bad, riding…]`` (the settings' digests, then the covered modules called) averaged
        over the ranks when a DistributedDataParallel wrapper averaged every closure call's gradients
        (:class:`DDPSync`) and every rank's gradients have the same :func:`fingerprint` (one slot per rank in
        the flag); None otherwise, after that one small all-reduce: the caller then averages the gradients
        itself."""
        sync = self._ddp_sync
        assert sync is not None
        grads = [p.grad for p in params]
        refuse_sparse(grads)
        slots = torch.zeros(self.comm.world_size, dtype=torch.float64, device=dev)
        signature = tuple(map(id, params))
        if not sync.trusts(signature):  # (a trusted set leaves its slot 0 on every rank: equal)
            slots[self.comm.rank] = fingerprint(grads, sync.projection).to(dev)
        flag = torch.cat([torch.tensor([1.0 if bad else 0.0] + riding, dtype=torch.float64, device=dev), slots])
        self.comm.allreduce([flag], op="mean")
        shares = flag[1 + len(riding):]
        if not bool((shares == shares[0]).all()):
            return None
        sync.verified(signature)
        return flag[:1 + len(riding)].to(dtype)

    def _grads_unscaled(self) -> bool:
        """Whether the closure unscaled the gradients itself (``scaler.unscale_(opt)``, to clip them):
        the ``GradScaler``'s stage for this optimizer (False for a callable scale or no scaler)."""
        states = getattr(self.grad_scaler, "_per_optimizer_states", None)
        stage = states.get(id(self), {}).get("stage") if isinstance(states, dict) else None
        return getattr(stage, "name", "") == "UNSCALED"

    def _unscale_grads(self) -> bool:
        """With a ``grad_scaler``: unscale ``p.grad`` in place (``scaler.unscale_``) and return False
        when a gradient overflowed — the step is then skipped, as GradScaler expects (not a fault),
        and leaves no trace: ``num_steps``, the curvature/decomposition schedule, momentum's step
        count and the random streams stay as if the batch was never seen (like torch.optim.Adam's
        ``step`` count under a skipped ``scaler.step``). The user calls ``scaler.update()`` after
        ``step`` as usual (not ``scaler.step``). Gradients the closure already unscaled with
        ``scaler.unscale_(opt)`` (to clip them) are not unscaled twice."""
        if self.grad_scaler is None:
            return True
        try:
            self.grad_scaler.unscale_(self)
        except RuntimeError as err:  # the closure unscaled them itself (to clip): torch's AMP recipe
            if "already been called" not in str(err):
                raise
        overflow = torch.tensor([0.0 if owned_all_finite([p.grad for p in params_with_grad(self.param_groups)[0]]) else 1.0])
        if self.comm.world_size > 1:  # every rank must skip together, or the replicas drift apart
            self.comm.allreduce([overflow], op="sum")
        if float(overflow) == 0.0:
            return True
        self.num_amp_skipped += 1
        logger.debug("step %d skipped by the grad scaler (inf/NaN gradients)", self.num_steps)
        return False

    def _what_is_nonfinite(self, loss: Any, fresh: Optional[Dict[str, Block]],
                           other_rank: bool = False) -> Callable[[], str]:
        """A function naming the non-finite loss, gradients (by parameter) and statistics (by module);
        ``other_rank``: the ranks did not agree the batch was finite (:meth:`_average_over_ranks`), so where this
        rank's are finite another rank's loss or batch was not."""
        def found() -> str:
            names = {id(p): n for n, p in self.model.named_parameters()}
            by_param = {names.get(id(p), "?"): p.grad for p in params_with_grad(self.param_groups)[0]}
            stats = {n: b.tensors() for n, b in (fresh or {}).items()}
            text = diagnose(loss, by_param, stats)
            if fresh is not None and not fresh:
                text = "; ".join(t for t in (text, "the model output") if t)
            if not text and other_rank:  # this rank's were finite: another rank flagged its batch
                text = "another rank's loss or batch (this rank's loss, gradients and statistics were finite)"
            return text
        return found

    def _refuse_nonfinite_targets(self, targets: Optional[Tensor], snapshot: Optional[StepUndo]) -> None:
        """On a step found non-finite: ValueError when ``targets`` hold NaN/inf where the curvature reads them
        (the empirical Fisher's and the Hessian's: missing labels a masked loss skips make it undefined there),
        instead of skipping step after step as if the model produced them. Checked on this failure path only
        (no cost on a finite step; every rank is on it together: one all-reduce, and every rank raises); the
        Fisher kinds do not read the targets (their failure is another)."""
        if self.engine.kind not in (Kind.EMPIRICAL_FISHER, Kind.HESSIAN):
            return
        mine = targets is not None and targets.is_floating_point() and not bool(torch.isfinite(targets).all())
        anywhere = mine if self.comm.world_size == 1 else not self._every_rank(not mine)
        if not anywhere:
            return
        if snapshot is not None:
            snapshot.restore()
        self.__dict__.pop("_loss_checked", None)  # (the first step's checks run again at the next step)
        where = f"{int((~torch.isfinite(targets)).sum())} non-finite (NaN/inf) entries of {targets.numel()} (shape " \
            f"{list(targets.shape)})" if mine else "non-finite (NaN/inf) entries on another rank"
        fix = ("leave targets= out: the empirical Fisher is then taken from your own backward of the masked loss"
               if self.engine.kind is Kind.EMPIRICAL_FISHER else
               "mask the output and the targets alike (output_selector=lambda out: out[mask], targets=y[mask]), with "
               "the closure's loss the mean over the kept entries")
        raise ValueError(f"targets has {where}: the curvature there is undefined "
                         f"(curvature={self.engine.kind.value!r} reads the targets). For missing labels a masked loss "
                         f"skips, {fix}; or use a Fisher kind, which does not read them. The optimizer state is "
                         "unchanged")

    @staticmethod
    def _batch_is_finite(loss: Tensor, grads: List[Tensor], fresh: Optional[Dict[str, Block]]) -> bool:
        """Loss, gradients and this batch's curvature are all finite ({} marks a non-finite output).
        The loss through :func:`all_finite` (it is in the user's graph), the gradients and fresh
        statistics — the optimizer's own — in one :func:`owned_all_finite`."""
        if (fresh is not None and not fresh) or not loss_is_finite(loss):
            return False
        owned = list(grads)
        if fresh:
            owned += [t for b in fresh.values() for t in b.tensors()]
        return owned_all_finite(owned)

    @property
    def max_consecutive_skips(self) -> Optional[int]:
        """Consecutive skipped steps after which the step raises :class:`NonFiniteError` (None: never)."""
        return self._streak.limit

    @max_consecutive_skips.setter
    def max_consecutive_skips(self, value: Optional[int]) -> None:
        self._streak = SkipStreak(value)

    def _keeps_output_grads(self, targets: Optional[Tensor]) -> bool:
        """Whether this closure call's watch keeps each output's gradient (a subclass's first-step check)."""
        return False

    def _categorical_use(self, targets: Optional[Tensor]) -> Optional[str]:
        """What uses the categorical likelihood of ``loss='cross_entropy'`` (for the closure watch's warning
        about a loss that is not a function of softmax(output)); None where nothing does: another loss, or
        the empirical Fisher from the user's own backward (the curvature of whatever loss it was)."""
        if self.engine.loss is not LossType.CROSS_ENTROPY:
            return None
        if self.engine.kind is Kind.EMPIRICAL_FISHER and targets is None:
            return None
        return "The curvature is that of a categorical likelihood."

    def _rows_counted(self, targets: Optional[Tensor]) -> Optional[str]:
        """How the curvature counts every row of a cross-entropy's output as an example (for the closure watch's
        warning about rows the loss leaves out: ``ignore_index``, a mask); None for the other losses, whose
        gradient rows may be exactly zero where an output equals its target."""
        if self.engine.loss is not LossType.CROSS_ENTROPY:
            return None
        kind = self.engine.kind
        if kind is Kind.EMPIRICAL_FISHER and targets is None:
            return ("the empirical Fisher from your backward averages its per-row terms over every row (with a loss "
                    "averaged over the valid rows only, it comes out scaled by rows / (valid rows))")
        drawn = " and draws labels for them" if kind is Kind.FISHER_MC else ""
        return f"curvature={kind.value!r} counts every row as an example of the batch{drawn}"

    def _plan(self, params: List[nn.Parameter], groups: List[Dict[str, Any]]) -> UpdatePlan:
        """The update's :class:`~torchsso2.optim.plan.UpdatePlan` (cached while nothing changes); a covered
        module with a gradient but no curvature block yet is looked at (:func:`.misuse.warn_blockless_modules`),
        and so is a block with parameters frozen since the optimizer was built (:func:`.plan.warn_partly_frozen`)."""
        plan = self._plans.get(params, groups, self.running.blocks)
        if plan.others:
            warn_blockless_modules(self, plan)
        warn_partly_frozen(self, plan)
        return plan

    def _forget_blocks(self, names: Sequence[str]) -> None:
        """After a failed decomposition, with earlier ones in use for the step: the blocks first seen in this
        step (a layer unfrozen or first called) have none, so they leave the running curvature; their
        modules take this step as before they were seen, and the next step meets them anew."""
        for name in names:
            self.running.blocks.pop(name, None)

    def _snapshot(self) -> StepUndo:
        """What a skipped step must give back (saved before the closure runs): the sampling
        generator and the normalisation layers' running statistics."""
        return self._undo.save(self.generator)

    def _step_taken(self) -> None:
        """End of a step that changed the parameters: the streak of skipped steps ends."""
        self._streak.taken()

    def _nonfinite(self, what: str, snapshot: Optional[StepUndo] = None,
                   found: Optional[Callable[[], str]] = None, reason: Optional[str] = None,
                   curvature_taken: bool = False) -> None:
        """Apply the non-finite policy: raise, or undo what the closure changed (``snapshot``: random
        streams, BatchNorm statistics), log and count a skipped step. ``num_steps`` does not advance,
        so the skipped step leaves the schedule and the random streams as if the batch was never seen.
        ``found`` names the non-finite tensors (called only for the stall error). ``reason``: why the step
        fails when nothing is non-finite (it then replaces "non-finite ``what``" in the messages).
        ``curvature_taken``: the running curvature took this step's (finite) estimate before the failure, which
        the raise-mode message says instead of "the optimizer state is unchanged"."""
        if snapshot is not None:
            snapshot.restore()
        problem = reason if reason is not None else f"non-finite {what}"
        if self.on_nonfinite == "raise":
            details = found() if found is not None else ""
            raise NonFiniteError(f"{problem} at step {self.num_steps}" + (f" ({details})" if details else "")
                                 + ("; the parameters are unchanged (the running curvature has taken this "
                                    "batch's estimate)" if curvature_taken else "; the optimizer state is unchanged"))
        self._count_skip()
        limit = self._streak.limit
        details = found() if found is not None and limit is not None and self._streak.count + 1 >= limit else ""
        streak = self._streak.skipped(self.num_steps, what, details, reason)
        # one line for the 1st, 2nd, 5th, 10th, 20th, ... skip (the others at DEBUG level)
        (logger.warning if worth_reporting(self.num_skipped) else logger.debug)(
            "step %d skipped: %s (skipped so far: %d; logged at 1, 2, 5, 10, 20, ... skips)",
            self.num_steps, problem, self.num_skipped)
        if streak in (10, 100, 1000) and (limit is None or streak < limit):
            if reason is not None:
                logger.error("%d consecutive steps were skipped, so training has stalled: %s.", streak, reason)
                return
            logger.error("%d consecutive steps were skipped: the model produces non-finite values at every step, so "
                         "training has stalled. Increase damping (or prior_precision / decrease dataset_size for "
                         "VIOptimizer), lower lr, or restore a checkpoint.", streak)

    def _count_skip(self) -> None:
        """``num_skipped`` += 1, once per step call (a failed decomposition and then a skipped update are one)."""
        if not self.__dict__.get("_skip_counted", False):
            self.num_skipped += 1
            self._skip_counted = True

    def _check_nonempty(self, output: Any) -> None:
        """The empty-batch ``ValueError`` for a step that records nothing (the estimating steps check
        every forward's output as it comes)."""
        if isinstance(output, Tensor) and output.dim() and output.shape[0] == 0:
            check_nonempty_batch(output)
        elif self.engine.output_selector is not None and not isinstance(output, Tensor):
            try:
                selected = self.engine.output_selector(output)
            except Exception:  # noqa: BLE001 - a closure output the selector does not take: not ours to judge here
                return
            check_nonempty_batch(selected)

    def _decomposition_failed(self, error: object, damping: float = 0.0) -> None:
        """Apply the policy to a failed decomposition: raise, or count a skipped step and warn (at 1, 2,
        5, 10, 20, ... skips). Without an earlier decomposition the step cannot update the parameters,
        so it extends the streak of skipped steps (``max_consecutive_skips`` raises at its limit)."""
        if self.on_nonfinite == "raise":
            raise NonFiniteError(f"decomposition failed at step {self.num_steps}: {error}")
        raised_to = self._damping_after_failed_decomposition(error)
        self._count_skip()
        in_float64 = self.decomposition_dtype == torch.float64 or all(
            p.dtype == torch.float64 for p in self.engine.params)
        (logger.warning if worth_reporting(self.num_skipped) else logger.debug)(
            "%s", decomposition_failed(self.num_steps, error, self._decomposed, torch.float64 if in_float64 else None,
                                       indefinite=self.engine.kind is Kind.HESSIAN, damping=damping,
                                       raised_to=raised_to))
        if not self._decomposed:
            self._streak.skipped(self.num_steps, "or failed decomposition", str(error))

    def _damping_after_failed_decomposition(self, error: object) -> Optional[float]:
        """A face with a damping rule raises the damping after a failed decomposition and returns the new one;
        None: the damping stays (the default)."""
        return None

    def _shortfall_probe(self) -> Tuple[type, ...]:
        """The block types whose damping shortfall a failed decomposition probes after the failing block (for
        :meth:`_damping_after_failed_decomposition`): none by default."""
        return ()

    def _decompose(self, damping: float, scale: float = 1.0) -> bool:
        """Decompose all running blocks; False (after applying the policy) if a decomposition failed."""
        if self.placement.active:  # [issue #7] each rank decomposes its share of blocks, then broadcasts
            error = self.placement.decompose(
                self.running.blocks, lambda blk: decompose_block(blk, damping, scale=scale, backend=self.linalg,
                                                                 dtype=self.decomposition_dtype,
                                                                 kfac_method=self.kfac_method, psd=self.running.psd),
                dtype=self.decomposition_dtype, kfac_method=self.kfac_method, probe=self._shortfall_probe())
            if error is not None:
                self._decomposition_failed(error, damping)
                return False
            self._decomposed, self._redamp_pending = True, False
            return True
        try:
            self.running.decompose(damping, scale=scale, backend=self.linalg, dtype=self.decomposition_dtype,
                                   kfac_method=self.kfac_method, probe=self._shortfall_probe())
        except LinalgError as err:
            self._decomposition_failed(err, damping)
            return False
        self._decomposed, self._redamp_pending = True, False
        return True

    # ---- distributed helpers [issue #7] --------------------------------------------------------
    def _precondition(self, blocks: Dict[str, Block], grads: Dict[int, Tensor]) -> Dict[int, Tensor]:
        """``(scale·C + damping·I)⁻¹ g`` per block, solved by the block's grad workers (see placement)."""
        return self.placement.precondition(blocks, grads)

    def _every_rank(self, ok: bool) -> bool:
        """Whether ``ok`` holds on every rank (one all-reduce; ``ok`` itself with one rank)."""
        return self._mean_over_ranks(1.0 if ok else 0.0) == 1.0

    def _mean_over_ranks(self, value: float) -> float:
        """Mean of a Python float over all ranks (the value itself with one rank)."""
        if self.comm.world_size <= 1:
            return value
        return float(self._mean_tensor_over_ranks(torch.tensor([value], dtype=torch.float64)).item())

    def _mean_tensor_over_ranks(self, values: Tensor) -> Tensor:
        """``values`` (any shape) averaged over all ranks in float64, on the CPU; ``values`` itself
        with one rank. The allreduce runs on the model's device (CUDA for NCCL)."""
        if self.comm.world_size <= 1:
            return values
        dev = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        box = values.detach().to(device=dev, dtype=torch.float64).clone()
        self.comm.allreduce([box], op="mean")
        return box.cpu()
