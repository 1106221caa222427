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

import logging
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from curvature import CurvatureEngine, RunningCurvature
from curvature.running import decompose_block
from curvature.blocks import Block, DiagBlock, FullBlock, KFACBlock
from curvature.blocks.base import all_finite, owned_all_finite
from curvature.linalg import LinalgError, get_backend
from curvature.options import Kind

from ..distributed import get_communicator
from .grid import agree_on_start, rank_seed  # [issue #7: distributed]
from .placement import Placement  # [issue #7: distributed]
from .messages import decomposition_failed
from .plan import PlanCache, ScalarCache, params_with_grad
from .precision import without_autocast
from .validation import check_choice, check_int, check_number, unpack_closure_result

logger = logging.getLogger(__name__)

Closure = Callable[[], Tuple[Tensor, Tensor]]
_BLOCK_TYPES = {"full": FullBlock, "diag": DiagBlock, "kfac": KFACBlock}


class NonFiniteError(FloatingPointError):
    """Raised under ``on_nonfinite="raise"`` when a gradient, a curvature statistic or a decomposition is not finite."""


class BlockAverage:
    """Weighted average of fresh blocks: the micro-batches of one closure (weights = batch sizes)
    or the MC weight samples of one VI step (equal weights). ``nonfinite`` marks a batch whose
    output was not finite; :meth:`result` then returns ``{}`` (the step applies the policy)."""

    def __init__(self) -> None:
        self.blocks: Optional[Dict[str, Block]] = None
        self.count = 0
        self.nonfinite = False

    def add(self, blocks: Dict[str, Block], n: int) -> None:
        if self.blocks is None:
            self.blocks, self.count = blocks, n
            return
        total = self.count + n
        for name, blk in self.blocks.items():
            for mine, new in zip(blk.tensors(), blocks[name].tensors()):
                mine.mul_(self.count / total).add_(new, alpha=n / total)
        self.count = total

    def result(self) -> Dict[str, Block]:
        if self.nonfinite:
            return {}
        assert self.blocks is not None
        return self.blocks


class CurvatureOptimizer(torch.optim.Optimizer):
    """Base class; see :class:`SecondOrderOptimizer` and :class:`VIOptimizer`."""

    def __init__(self, model: nn.Module, params: Optional[Iterable[Any]], defaults: Dict[str, Any], *,
                 curvature: str, approx: Any, loss: str, mc_samples: int, skip_modules: Any,
                 ema_decay: float, curv_update_interval: int, inv_update_interval: int,
                 on_nonfinite: str, linalg: Optional[str], communicator: Any, seed: Optional[int],
                 decomposition_dtype: Optional[torch.dtype], grad_scaler: Any = None,
                 grad_worker_fraction: Any = "comm_opt", assignment_strategy: Any = "compute",
                 output_selector: Any = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.engine = CurvatureEngine(model, kind=curvature, approx=approx, loss=loss, mc_samples=mc_samples,
                                      skip_modules=skip_modules, output_selector=output_selector)
        self.ema_decay = check_number("ema_decay", ema_decay, low=0.0, high=1.0, high_open=True)
        self.curv_update_interval = check_int("curv_update_interval", curv_update_interval)
        self.inv_update_interval = check_int("inv_update_interval", inv_update_interval)
        self.on_nonfinite = check_choice("on_nonfinite", on_nonfinite, ("skip", "raise"))
        get_backend(linalg)  # validates the name (and cupy's availability) now, not at the first decomposition
        self.linalg = linalg
        if grad_scaler is not None and not all(hasattr(grad_scaler, a) for a in ("unscale_", "get_scale")):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}")
        self.grad_scaler = grad_scaler
        self.num_amp_skipped = 0
        if decomposition_dtype not in (None, torch.float32, torch.float64):
            raise ValueError(f"decomposition_dtype={decomposition_dtype!r}; expected None, torch.float32 or torch.float64")
        self.decomposition_dtype = decomposition_dtype
        if params is None:
            params = [p for p in model.parameters() if p.requires_grad]
        super().__init__(params, defaults)
        self.running = RunningCurvature()
        #: how K-FAC blocks are decomposed: "eigen" (exact damping) or "inverse" (factored; SecondOrderOptimizer)
        self.kfac_method = "eigen"
        self._plans = PlanCache()      # per-step bookkeeping of the update (torchsso2/optim/plan.py)
        self._scalars = ScalarCache()  # hyperparameters as cached 0-dim tensors for foreach ops
        self.comm = communicator if not isinstance(communicator, (str, type(None))) else \
            get_communicator(communicator or "auto")
        # [issue #7: distributed] KAISA placement of the decompositions (torchsso2/optim/placement.py);
        # all ranks start from rank 0's weights and seed; label sampling is decorrelated per rank
        # (rank 0 keeps `seed`, so one process is unchanged).
        self.placement = Placement(self.comm, grad_worker_fraction, assignment_strategy)
        self.seed = agree_on_start(self.comm, model,
                                   int(seed) if seed is not None else int(torch.initial_seed()) % (2 ** 62))
        self.generator = torch.Generator()
        self.generator.manual_seed(rank_seed(self.seed, self.comm.rank))
        # [end issue #7]
        self.num_steps = 0
        self.num_skipped = 0
        self._skip_run: Tuple[int, int] = (-2, 0)  # (step of the last skip, consecutive skips up to it)
        self._decomposed = False
        self._average_gradients = not isinstance(model, nn.parallel.DistributedDataParallel)

    # ---- capture + estimate -------------------------------------------------------------
    def _run_closure(self, closure: Closure, targets: Optional[Tensor], estimate: bool
                     ) -> Tuple[Tensor, Tensor, Optional[Dict[str, Block]]]:
        """Run the closure once; when ``estimate``, also estimate this batch's curvature."""
        if closure is None or not callable(closure):
            raise TypeError("step() needs a closure returning (loss, output); see the class docstring")
        if not estimate:
            with torch.enable_grad():
                loss, output = unpack_closure_result(closure())
            return loss, output, None
        engine = self.engine
        from_backward = engine.kind is Kind.EMPIRICAL_FISHER and targets is None
        acc = BlockAverage()

        def on_output(out: Tensor) -> None:
            # called after every forward of the model inside the closure: a closure may run
            # several micro-batches (gradient accumulation); their curvature is averaged
            # weighted by batch size, so K micro-batches of B equal one batch of K·B.
            if from_backward:
                return
            if not all_finite([out]):
                acc.nonfinite = True
            else:
                with without_autocast():  # statistics in float32 from the autocast activations
                    acc.add(engine.estimate(cap, out, targets, self.generator), out.shape[0])
            cap.records.clear()

        with torch.enable_grad(), engine.capture(on_output=on_output, record_backward=from_backward) as cap:
            loss, output = unpack_closure_result(closure())
        if from_backward:
            if len(cap.outputs) > 1:
                raise ValueError("curvature='empirical_fisher' without targets supports one forward per closure; "
                                 "pass targets=... to step() for gradient accumulation")
            if cap.outputs:
                n = cap.outputs[0].shape[0]
                scale = float(self.grad_scaler.get_scale()) if self.grad_scaler is not None else 1.0
                acc.add(engine.estimate_from_backward(cap, loss_scale=n / scale), n)
        if acc.blocks is None and not acc.nonfinite:
            raise RuntimeError("the closure did not run the model's forward; call model(...) inside the closure")
        return loss, output, acc.result()

    # ---- gradients -------------------------------------------------------------------------
    def _average_over_ranks(self, grads: List[Tensor], blocks: Optional[Dict[str, Block]],
                            loss: Optional[Tensor] = None) -> bool:
        """Mean of gradients and fresh curvature over all ranks, in place.

        Returns False on every rank when some rank's loss was not finite or its batch was
        marked non-finite (``blocks == {}``); the block all-reduce is then skipped everywhere,
        so all ranks take the same branch of the non-finite policy. (Non-finite gradients
        and statistics need no flag: the mean spreads them to every rank.)
        """
        if self.comm.world_size <= 1:
            return True
        bad = (blocks is not None and not blocks) or \
            (isinstance(loss, Tensor) and not all_finite([loss]))
        dev = grads[0].device if grads else next((p.device for p in self.model.parameters()), torch.device("cpu"))
        flag = torch.tensor([1.0 if bad else 0.0], dtype=grads[0].dtype if grads else torch.float64, device=dev)
        if self._average_gradients and grads:
            self.comm.allreduce(list(grads) + [flag], op="mean")  # the flag rides in the gradients' bucket
        else:
            self.comm.allreduce([flag], op="mean")
        if float(flag.item()) > 0:
            return False
        if blocks:
            sym = [t for b in blocks.values() for t, s in zip(b.tensors(), b.symmetric()) if s]
            rest = [t for b in blocks.values() for t, s in zip(b.tensors(), b.symmetric()) if not s]
            if sym:
                self.comm.allreduce(sym, op="mean", symmetric=True)
            if rest:
                self.comm.allreduce(rest, op="mean")
        return True

    def _unscale_grads(self) -> bool:
        """With a ``grad_scaler``: unscale ``p.grad`` in place (``scaler.unscale_``) and return False
        when a gradient overflowed — the step is then skipped, as GradScaler expects (not a fault).
        The user calls ``scaler.update()`` after ``step`` as usual (not ``scaler.step``)."""
        if self.grad_scaler is None:
            return True
        self.grad_scaler.unscale_(self)
        overflow = torch.tensor([0.0 if owned_all_finite([p.grad for p in params_with_grad(self.param_groups)[0]]) else 1.0])
        if self.comm.world_size > 1:  # every rank must skip together, or the replicas drift apart
            self.comm.allreduce([overflow], op="sum")
        if float(overflow) == 0.0:
            return True
        self.num_amp_skipped += 1
        logger.debug("step %d skipped by the grad scaler (inf/NaN gradients)", self.num_steps)
        return False

    @staticmethod
    def _batch_is_finite(loss: Tensor, grads: List[Tensor], fresh: Optional[Dict[str, Block]]) -> bool:
        """Loss, gradients and this batch's curvature are all finite ({} marks a non-finite output).
        The loss through :func:`all_finite` (it is in the user's graph), the gradients and fresh
        statistics — the optimizer's own — in one :func:`owned_all_finite`."""
        if fresh is not None and not fresh:
            return False
        if isinstance(loss, Tensor) and not all_finite([loss]):
            return False
        owned = list(grads)
        if fresh:
            owned += [t for b in fresh.values() for t in b.tensors()]
        return owned_all_finite(owned)

    def _nonfinite(self, what: str) -> None:
        """Apply the non-finite policy: raise, or log and count a skipped step."""
        if self.on_nonfinite == "raise":
            raise NonFiniteError(f"non-finite {what} at step {self.num_steps}; the optimizer state is unchanged")
        self.num_skipped += 1
        last, streak = self._skip_run
        streak = streak + 1 if last == self.num_steps - 1 else 1
        self._skip_run = (self.num_steps, streak)
        logger.warning("step %d skipped: non-finite %s (skipped so far: %d)", self.num_steps, what, self.num_skipped)
        if streak in (10, 100, 1000):
            logger.error("%d consecutive steps were skipped: the model produces non-finite values at every step, so "
                         "training has stalled. Increase damping (or prior_precision / decrease dataset_size for "
                         "VIOptimizer), lower lr, or restore a checkpoint.", streak)

    def _decompose(self, damping: float, scale: float = 1.0) -> bool:
        """Decompose all running blocks; False (after applying the policy) if a decomposition failed."""
        if self.placement.active:  # [issue #7] each rank decomposes its share of blocks, then broadcasts
            error = self.placement.decompose(
                self.running.blocks, lambda blk: decompose_block(blk, damping, scale=scale, backend=self.linalg,
                                                                 dtype=self.decomposition_dtype,
                                                                 kfac_method=self.kfac_method),
                dtype=self.decomposition_dtype, kfac_method=self.kfac_method)
            if error is not None:
                if self.on_nonfinite == "raise":
                    raise NonFiniteError(f"decomposition failed at step {self.num_steps}: {error}")
                self.num_skipped += 1
                logger.warning("%s", decomposition_failed(self.num_steps, error, self._decomposed,
                                                          self.decomposition_dtype))
                return False
            self._decomposed = True
            return True
        try:
            self.running.decompose(damping, scale=scale, backend=self.linalg, dtype=self.decomposition_dtype,
                                   kfac_method=self.kfac_method)
        except LinalgError as err:
            if self.on_nonfinite == "raise":
                raise NonFiniteError(f"decomposition failed at step {self.num_steps}: {err}") from err
            self.num_skipped += 1
            logger.warning("%s", decomposition_failed(self.num_steps, err, self._decomposed, self.decomposition_dtype))
            return False
        self._decomposed = True
        return True

    # ---- distributed helpers [issue #7] --------------------------------------------------------
    def _precondition(self, blocks: Dict[str, Block], grads: Dict[int, Tensor]) -> Dict[int, Tensor]:
        """``(scale·C + damping·I)⁻¹ g`` per block, solved by the block's grad workers (see placement)."""
        return self.placement.precondition(blocks, grads)

    def _mean_over_ranks(self, value: float) -> float:
        """Mean of a Python float over all ranks (the value itself with one rank)."""
        if self.comm.world_size <= 1:
            return value
        dev = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        box = torch.tensor([value], dtype=torch.float64, device=dev)
        self.comm.allreduce([box], op="mean")
        return float(box.item())

    # ---- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        sd = super().state_dict()
        sd["torchsso2"] = {
            "curvature": self.running.state_dict(),
            "generator": self.generator.get_state(),
            "num_steps": self.num_steps,
            "num_skipped": self.num_skipped,
            "decomposed": self._decomposed,
            "seed": self.seed,
            "covered": {n: list(lay.param_names) for n, lay in self.engine.layouts.items()},
            "param_shapes": self._param_shapes(),
            "extra": self._extra_state(),
        }
        return sd

    def _param_shapes(self) -> List[List[int]]:
        return [list(p.shape) for g in self.param_groups for p in g["params"]]

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        sd = dict(state_dict)
        extra = sd.pop("torchsso2", None)
        if extra is None:
            raise ValueError("state_dict has no 'torchsso2' entry: it was not saved by this optimizer")
        covered = {n: list(lay.param_names) for n, lay in self.engine.layouts.items()}
        if extra["covered"] != covered:
            raise ValueError(f"checkpoint is for a model covering {extra['covered']}, this model covers {covered}")
        # validate everything before changing anything: a refused checkpoint leaves the optimizer as it was
        shapes = self._param_shapes()
        if extra.get("param_shapes", shapes) != shapes:
            raise ValueError(f"checkpoint is for parameters of shapes {extra['param_shapes']}, "
                             f"this optimizer's parameters have shapes {shapes}")
        for name, bstate in extra["curvature"]["blocks"].items():
            want = self.engine.approx[name].value if name in self.engine.approx else None
            if bstate["approx"] != want:
                raise ValueError(f"checkpoint holds a {bstate['approx']!r} block for module {name!r}, "
                                 f"this optimizer uses {want!r}")
        super().load_state_dict(sd)
        cstate = extra["curvature"]
        like = {}
        for name, bstate in cstate["blocks"].items():
            lay = self.engine.layouts[name]
            cls = _BLOCK_TYPES[bstate["approx"]]
            like[name] = cls(lay, *[t.clone() for t in bstate["tensors"]])
        self.running.load_state_dict(cstate, like)
        self.generator.set_state(extra["generator"])
        self.num_steps = int(extra["num_steps"])
        self.num_skipped = int(extra["num_skipped"])
        self._decomposed = bool(extra["decomposed"])
        self.seed = int(extra.get("seed", self.seed))
        if self.placement.active:  # [issue #7] the saving rank may lack some decompositions: redo them
            self._decomposed = False
        if any(isinstance(b, KFACBlock) and b.decomposition is not None
               and b.decomposition.get("method") != self.kfac_method for b in self.running.blocks.values()):
            self._decomposed = False  # saved with the other kfac_method: decompose again at the next step
        self._load_extra_state(extra["extra"])

    def _extra_state(self) -> Dict[str, Any]:
        return {}

    def _load_extra_state(self, state: Dict[str, Any]) -> None:
        pass
