"""The curvature engine: capture → estimate, shared by every public face.

:class:`CurvatureEngine` knows which modules are covered and in which shape; it records a
forward (:meth:`capture`) and turns the record into one fresh block per module
(:meth:`estimate`). It holds no running state: EMAs, decompositions and communication
belong to whoever uses the blocks (see :class:`curvature.running.RunningCurvature`).
"""
from __future__ import annotations

import contextlib
import logging
import re
from typing import AbstractSet, Any, Callable, Collection, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from . import likelihoods, sequence
from .blocks import Block, DiagBlock, FullBlock, KFACBlock, Layout
from .blocks.base import compute_dtype
from .blocks.layout import held_parameters, kfac_dense_sides
from .capture import Capture, ModuleRecord, batch_norm_modules
from .cost import warn_full_blocks, warn_kfac_factors
from .hessian import hessian_blocks
from .hook_marks import HiddenPasses
from .frozen_norm import KeptStatistics, statistics_norms
from .modules import SUPPORTED_LAYERS, family_of
from .modules.parameters import ParameterFamily
from .modules.base import flat_per_example
from .modules.linear import LinearFamily, WeightMatrixFamily
from .options import Approx, Kind, KFACApprox, LossType, check_mc_samples, parse
from .selection import ApproxSpec, SkipSpec, covered_parameters, select_layouts
from .tied import check_kfac_tied, combine_kfac, tied_per_example_sum
from .uses import reaches

logger = logging.getLogger(__name__)

#: per-example gradients are materialized at most this many examples at a time (diag/full)
_EXAMPLE_CHUNK = 64
#: looped backward passes are stacked into chunks of at most this many output-gradient elements
#: (all covered modules together), so the blocks are built from a few wide products, not K narrow ones
_GRAD_CHUNK_ELEMENTS = 1 << 23

#: PyTorch >= 2.1 documents that a tensor hook registered before an in-place modification receives the
#: gradient with respect to the value before it (what :class:`Capture`'s ``shape_only`` relies on)
HOOKS_SEE_VALUE_BEFORE_INPLACE = tuple(int(p) for p in torch.__version__.split(".")[:2] if p.isdigit()) >= (2, 1)


def prefers_batched_backward(model: nn.Module) -> bool:
    """Whether the K backward passes of the exact Fisher should run as one vmapped backward.

    vmap batches Linear/elementwise backwards into wider matmuls (MLP 64-256-256-10, N=128, K=9:
    1.8 ms vs 2.7 ms for the loop), but its rule for ``convolution_backward`` runs one
    convolution per vector and then copies the results together, so on convolutional models
    the plain loop is faster (CNN 3-16-32 on 16×16, N=128: 52 ms batched vs 30 ms looped).
    """
    return not any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


def _scaled_sum(tensors: List[Tensor], scale: float) -> Tensor:
    """``scale · Σ tensors`` (summed left to right) in one pass for a single tensor: the builtin
    ``sum`` starts with ``0 + t``, a copy of the whole output gradient (digits CNN conv1 at batch 128:
    65k floats) before the scaling copies it again."""
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total * scale


def compile_advice(owner: str) -> str:
    """How a torch.compile'd model whose graph was traced before ``owner`` existed gets ``owner``'s hooks."""
    return f"build {owner} before the compiled model's first call, or call torch._dynamo.reset() after building it"


def compiled_before_hooks(what: str, owner: str = "the optimizer", uncompiled: bool = True) -> str:
    """The message for a compiled model whose graph was traced before ``owner``'s recording hooks existed
    (``uncompiled``: also name curvature.compute's other way, the uncompiled module)."""
    return (f"{what}: the model is torch.compile'd and its graph was traced before {owner}'s hooks existed (a "
            f"call before {owner} was built, e.g. a warm-up or an earlier training run), so it runs without them: "
            + compile_advice(owner)
            + (" (curvature.compute: or pass the uncompiled module, compiled._orig_mod)" if uncompiled else ""))


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` runs through torch.compile: ``torch.compile(model)`` (an ``OptimizedModule``) or
    ``model.compile()`` in place."""
    return hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None


def contains_compiled(model: nn.Module) -> bool:
    """Whether ``model`` or a submodule runs through torch.compile (a LightningModule holding
    ``self.net = torch.compile(net)``)."""
    return any(is_compiled(m) for m in model.modules())


def _check_reached(grads: Sequence[Optional[Tensor]], names: Sequence[str]) -> None:
    """ValueError when the model output reaches none of the covered modules' recorded outputs (each
    gradient None). A module the output does not use has zero blocks, but not every module: the
    output came from another forward than the recorded calls, e.g. ``torch.compile(model)(x)`` inside
    the closure of an optimizer built on ``model`` (its compiled graph does not run the modules'
    recorded calls), which would silently give zero curvature."""
    if grads and all(g is None for g in grads):
        raise ValueError(
            f"the model output does not depend on the recorded outputs of any covered module ({', '.join(names)}): "
            "the closure's output did not come from the forward the optimizer recorded, e.g. a torch.compile'd "
            "model called inside the closure of an optimizer built on the uncompiled one. Build the optimizer on "
            "the module the closure calls (opt = SecondOrderOptimizer(compiled_model, ...)), or call the model "
            "itself in the closure")


class CurvatureEngine:
    """Capture and estimation of ``kind`` curvature in per-module shapes.

    Args:
        model: any ``nn.Module``; covered modules are found by :func:`select_layouts`.
        kind: ``"fisher" | "fisher_mc" | "empirical_fisher" | "hessian"``.
        approx: a shape name or a dict (see :mod:`curvature.selection`).
        loss: ``"cross_entropy" | "mse" | "binary_cross_entropy"``.
        mc_samples: labels sampled per example for ``fisher_mc`` (>= 1).
        skip_modules: module names (regex), class names or types to leave uncovered, each with
            its submodules.
        output_selector: maps the model's forward output to the tensor the loss is computed
            from (for models that return a tuple, dict or output object); default: the output.
        kfac_approx: ``"expand" | "reduce"``: K-FAC of Linear-like layers (Linear, Conv1d/2d, the
            attention in-projection) applied over positions ``T`` (:class:`curvature.options.KFACApprox`).
            Embedding blocks are K-FAC-expand either way (their input factor is diagonal only there).
    """

    def __init__(self, model: nn.Module, kind: str = "fisher", approx: ApproxSpec = "kfac",
                 loss: str = "cross_entropy", mc_samples: int = 1, skip_modules: SkipSpec = None,
                 output_selector: Optional[Callable[[Any], Tensor]] = None, kfac_approx: str = "expand",
                 include: Optional[AbstractSet[int]] = None, any_module: bool = False) -> None:
        self.kind = parse(Kind, kind, "kind")
        self.kfac_approx = parse(KFACApprox, kfac_approx, "kfac_approx")
        if output_selector is not None and not callable(output_selector):
            raise TypeError(f"output_selector must be a callable (model output -> Tensor), got {output_selector!r}")
        self.output_selector = output_selector
        self.loss = parse(LossType, loss, "loss")
        self.mc_samples = check_mc_samples(mc_samples, self.kind.value)
        self.model = model
        #: ``with engine.hidden_passes():`` hides the passes run inside from preconditioners on the model
        self.hidden_passes = HiddenPasses(model)
        #: modules no layer family covers get diagonal blocks for gradient-only estimators (select_layouts)
        self.any_module = any_module
        self.layouts, self.approx = select_layouts(model, approx, skip_modules, include, any_module)
        #: the modules covered that way (ParameterFamily): no capture-based estimate for them
        self.generic = [n for n, lay in self.layouts.items() if isinstance(lay.family, ParameterFamily)]
        #: backpropagate the K vectors in one vmapped backward (see :func:`prefers_batched_backward`)
        self.batched_backward = prefers_batched_backward(model)
        #: the BatchNorms a capture may route (found once, like the covered modules)
        self.batch_norms = batch_norm_modules(model)
        #: the norm layers' running statistics, put back after the estimate's own backward passes (which re-run
        #: an activation-checkpointed forward, and a training-mode BatchNorm there would count the batch again)
        self.kept_statistics = KeptStatistics(statistics_norms(model))
        self._modules = {n: lay.module for n, lay in self.layouts.items()}
        #: a covered module the forward did not call, and on whose parameters the output does not depend
        #: (a multi-task head other batches use), is left out of the estimate instead of a ValueError;
        #: the optimizers set it (their ranks average a module's blocks with zeros from the ranks that did
        #: not call it, torchsso2/optim/routing.py)
        self.allow_uncalled = False
        #: shape signatures whose module outputs were checked to hold the examples first
        self._examples_checked: set = set()
        full = {n: sum(q.numel() for q in lay.params) for n, lay in self.layouts.items()
                if self.approx[n] is Approx.FULL}
        if full:  # announce large full blocks (P² numbers, ~9P³ FLOPs a decomposition) before they are built
            # the blocks are stored in the statistics' dtype (float32 or wider), not the model's
            itemsize = max(compute_dtype(self.layouts[n].params[0].dtype).itemsize for n in full)
            warn_full_blocks(full, itemsize, f"{self.kind.value}")
        # announce K-FAC factors too large to decompose often (an LM head's [V, V])
        kfac = {n: kfac_dense_sides(lay) for n, lay in self.layouts.items() if self.approx[n] is Approx.KFAC}
        if kfac:
            warn_kfac_factors(kfac, max(compute_dtype(self.layouts[n].params[0].dtype).itemsize for n in kfac))
        for lay in self.layouts.values():  # modules using a tied parameter are recorded too (curvature.tied)
            for use in lay.tied:
                self._modules.setdefault(use.name, use.module)
            if lay.tied and self.approx[lay.name] is Approx.KFAC:
                check_kfac_tied(lay)
        if self.kind is Kind.HESSIAN:
            bad = [n for n, a in self.approx.items() if a is Approx.KFAC]
            if bad:
                raise NotImplementedError(
                    f"K-FAC of the Hessian is not implemented (modules {bad}); use approx='full' or 'diag' "
                    "with kind='hessian', or a Fisher kind with K-FAC")

    @property
    def params(self) -> list:
        """Covered parameters in ``named_parameters`` order."""
        return covered_parameters(self.layouts)

    def select_output(self, output: Any) -> Tensor:
        """The tensor the loss is computed from: ``output_selector(output)``, or ``output``
        itself; a TypeError names ``output_selector`` when that is not a Tensor."""
        out = output if self.output_selector is None else self.output_selector(output)
        if not isinstance(out, Tensor):
            how = "output_selector returned" if self.output_selector is not None else "the model returned"
            raise TypeError(f"{how} {type(out).__name__}, expected the Tensor the loss is computed from "
                            "(logits [N, C] or the regression output); for a model that returns a tuple, dict "
                            "or output object pass output_selector=..., e.g. lambda out: out['logits'] or "
                            "lambda out: out[0]")
        return out

    def capture(self, on_output: Optional[Callable[[Tensor], None]] = None,
                record_backward: bool = False) -> Capture:
        """A context manager recording the next forward of the model.

        BatchNorms are routed (:mod:`curvature.frozen_norm`) only when the engine will run its own
        backward passes on the record: not for blocks from the user's backward, nor for the Hessian.
        NotImplementedError when some covered module has no layer family (``any_module``): its
        curvature comes from gradients alone, not from a recorded forward."""
        if self.generic:
            raise NotImplementedError(
                f"modules {self.generic} have no layer curvature (their blocks are filled from the parameters' "
                f"gradients alone, VIOptimizer's curvature='reparam'); kind={self.kind.value!r} needs each covered "
                f"layer's inputs and output gradients, which only the layers {SUPPORTED_LAYERS} give")
        for lay in self.layouts.values():  # a covered parameter a reparametrization (prune, parametrize) moved since:
            held_parameters(lay.name, lay.module, lay.param_names)  # its own error, not the functional use shown later
        own_backward = not record_backward and self.kind is not Kind.HESSIAN
        # from the user's backward, a family that reads only the output's shape needs no clone of it
        # (Capture's shape_only; digits CNN at batch 128: ~25 µs a curvature step)
        shape_only = [n for n, m in self._modules.items()
                      if not (self.layouts[n].family if n in self.layouts else family_of(m)).reads_output_values] \
            if record_backward and HOOKS_SEE_VALUE_BEFORE_INPLACE else ()
        # the Hessian differentiates the loss itself and sees every call of a module (a layer reused in the
        # forward, as in an unrolled RNN): the first call's record serves its fast diagonal path only where
        # the parameters have no other use (curvature.hessian_diag.uses_only_through)
        return Capture(self._modules, root=self.model, on_output=on_output, record_backward=record_backward,
                       on_reuse="count" if self.kind is Kind.HESSIAN else "raise",
                       freeze_batch_stats=own_backward and bool(self.batch_norms), select_output=self.select_output,
                       batch_norms=self.batch_norms, check_uses=self.kind is not Kind.HESSIAN, shape_only=shape_only)

    # ---- estimation -------------------------------------------------------------------
    def estimate(self, capture: Capture, outputs: Tensor, targets: Optional[Tensor] = None,
                 generator: Optional[torch.Generator] = None) -> Dict[str, Block]:
        """Fresh blocks of the curvature of the mean loss over the recorded batch.

        ``outputs``: the model output recorded by ``capture`` (still in the graph; cross-entropy
        logits ``[N, T, C]`` count as ``N·T`` rows, :func:`curvature.likelihoods.as_rows`);
        ``targets``: needed for ``empirical_fisher`` and ``hessian``. The backward passes it runs are
        hidden from a ``KFACPreconditioner`` on the model (:attr:`hidden_passes`), and leave the norm layers'
        running statistics as they were (:attr:`kept_statistics`: an activation-checkpointed forward re-run by
        them would update a training-mode BatchNorm's again).
        """
        with self.hidden_passes(), self.kept_statistics:
            return self._estimate(capture, outputs, targets, generator)

    def _estimate(self, capture: Capture, outputs: Tensor, targets: Optional[Tensor] = None,
                  generator: Optional[torch.Generator] = None) -> Dict[str, Block]:
        likelihoods.check_outputs_targets(self.loss, outputs, targets)
        given = outputs, targets
        outputs, targets = likelihoods.as_rows(self.loss, outputs, targets)  # [N, T, C] logits: N·T rows
        if self.kind in (Kind.EMPIRICAL_FISHER, Kind.HESSIAN) and targets is None:
            raise ValueError(f"kind={self.kind.value!r} needs the targets")
        missing = [n for n in self._modules if n not in capture.records]
        if missing:
            self._refuse_replaced(missing)
        if missing and self.allow_uncalled and not capture.called_without_grad.intersection(missing) \
                and self._unused(missing, outputs):
            with self.restricted_to(capture.records):  # the blocks of the modules this forward called
                return self.estimate(capture, *given, generator=generator)
        if missing:
            self._refuse_uncalled(capture, missing)
        if self.kind is Kind.HESSIAN:
            loss = likelihoods.mean_nll(self.loss, outputs, targets)
            coupled = any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                          and (m.training or m.running_mean is None) for m in self.batch_norms)
            try:
                return hessian_blocks(loss, self.layouts, self.approx, capture.records, examples_independent=not coupled,
                                      announced=self.__dict__.setdefault("_announced_costs", set()))
            except RuntimeError as err:
                if "double backward" in str(err) and contains_compiled(self.model):
                    raise ValueError(
                        f"kind='hessian' differentiates the model's backward, which a torch.compile'd model with an "
                        f"aot_autograd backend (the default inductor, aot_eager) does not support ({err}). Compile "
                        "with backend='eager', or take the Hessian of the uncompiled module (compiled._orig_mod)") from err
                if "derivative for" not in str(err) or "not implemented" not in str(err):
                    raise
                raise NotImplementedError(
                    f"kind='hessian' needs the second derivative of every op of the model, and torch has none for "
                    f"one of them ({err}). For F.scaled_dot_product_attention run the forward under "
                    "torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), whose backward is "
                    "differentiable; or use a Fisher kind") from err
        self._refuse_unbatched_calls(capture.records)
        per_example = self.check_examples_align(capture.records, outputs)
        n_given = given[0].shape[0] if given[0].dim() > 2 else 0
        if per_example == 1 and self.kind is Kind.EMPIRICAL_FISHER and 0 < n_given < outputs.shape[0] \
                and outputs.shape[0] % n_given == 0 and self._full_or_diag_sees(capture, outputs.shape[0]):
            # [N, T, C] logits whose other covered modules are K-FAC (which sums per row, any layout) or absent:
            # the empirical Fisher's example is still the sequence (a full/diag head on the rows sums each T)
            per_example = outputs.shape[0] // n_given
        if self.kfac_approx is KFACApprox.REDUCE:
            self._check_reduce_layout(capture, outputs, given[0])
        vectors = likelihoods.backprop_vectors(self.loss, self.kind, outputs, targets,
                                               self.mc_samples, generator)
        if per_example > 1:  # sequence outputs: rows inside module examples (curvature.sequence)
            # (under the empirical Fisher a K-FAC module sums per-row products in any layout: not checked, as in
            # rows_per_example; an expert called on x[rows] may see N rows by chance)
            approx = self._module_approx() if self.kind is Kind.EMPIRICAL_FISHER else {}
            outs = {n: capture.records[n].output for n in self._modules
                    if capture.records[n].output.dim() and capture.records[n].output.shape[0] != outputs.shape[0]
                    and approx.get(n) is not Approx.KFAC}
            # the exact Fisher's per-position vectors and the empirical Fisher's sums over the rows of a module
            # that sees them (full and diagonal blocks; K-FAC sums per-row products) take row r as one of
            # example r // T: every example's rows are checked there
            sees_rows = self._full_or_diag_sees(capture, outputs.shape[0])
            with capture.frozen.on():
                sequence.check_example_major_rows(outputs, outs, per_example,
                                                  every_example=self.kind is Kind.FISHER or sees_rows)
        elif self.kind in (Kind.FISHER, Kind.EMPIRICAL_FISHER):
            self._check_examples_first(capture, outputs)
        if per_example > 1 and self.kind is Kind.FISHER:
            chunks = self._per_position_grad_chunks(capture, outputs, vectors, per_example)
        else:
            chunks = self.output_grad_chunks(capture, outputs, vectors)
        # the empirical Fisher's example is the sequence: a module that sees the N·T rows (a head on
        # reshaped activations) sums its per-row gradients per sequence (the fisher kind localizes instead)
        group = per_example if self.kind is Kind.EMPIRICAL_FISHER else 1
        return self.blocks_from_grad_chunks(capture.records, chunks, outputs.shape[0], group_rows=group)

    def _unused(self, names: Sequence[str], outputs: Tensor) -> bool:
        """Whether the modules ``names`` (not called in the recorded forward) are plain covered modules
        (no tied parameter) whose parameters ``outputs`` does not depend on (no ``AccumulateGrad`` of
        them in its graph: no functional use, no reentrant checkpointing)."""
        tied = {u.name for lay in self.layouts.values() for u in lay.tied}
        if any(n not in self.layouts or self.layouts[n].tied or n in tied for n in names):
            return False
        return not reaches(outputs, [p for n in names for p in self.layouts[n].params])

    @contextlib.contextmanager
    def restricted_to(self, records: Collection[str]) -> Iterator[None]:
        """The engine's covered modules, layouts and shapes restricted to those named in ``records`` (a
        dict of records or a set of names)."""
        saved = self._modules, self.layouts, self.approx
        self._modules = {n: m for n, m in self._modules.items() if n in records}
        self.layouts = {n: lay for n, lay in self.layouts.items() if n in records}
        self.approx = {n: a for n, a in self.approx.items() if n in records}
        try:
            yield
        finally:
            self._modules, self.layouts, self.approx = saved

    def _check_examples_first(self, capture: Capture, outputs: Tensor) -> None:
        """ValueError unless the first dimension of every covered module's output holds the examples (for
        the exact Fisher in every shape, for the empirical Fisher in full and diagonal blocks; its K-FAC
        blocks sum per-row products and take any layout): both sum per-example products taken there,
        and a sequence-first ``[T, N, d]`` activation with ``T == N``, or a module broadcast over the
        examples whose first dimension is ``N`` (a position embedding on ``arange(T)``, ``T == N``),
        passes the size check of :meth:`check_examples_align`, and so does a model mixing its examples
        (``z - z.mean(0)``). ``2·⌈log₂ N⌉`` backward passes (every example's loss rows,
        :func:`curvature.sequence.check_example_major_rows`) per batch size (and set of modules holding it
        first) tell them apart."""
        n = outputs.shape[0]
        approx = self._module_approx()
        # every module whose first dimension has the examples' size: a sequence-first [T, N, d] activation
        # with T == N, or a module broadcast over the examples whose size happens to be N (a position
        # embedding on arange(T), T == N), passes the size check; the empirical Fisher's K-FAC blocks take
        # any layout (per-row products of the summed loss's gradient) and need no check
        outs = {name: capture.records[name].output for name in self._modules
                if (approx[name] is not Approx.KFAC or self.kind is Kind.FISHER)
                and capture.records[name].output.dim() > 1 and capture.records[name].output.shape[0] == n > 1}
        if not outs:
            return
        # what the test depends on: the examples and which modules have them first (not a sequence length, which
        # varies with dynamic padding: each new one would pay the 2·⌈log₂ N⌉ passes again)
        signature = (n, tuple((name, o.dim()) for name, o in outs.items()))
        if signature in self._examples_checked:
            return
        with capture.frozen.on():  # every example (the first one's path may stop short of the mixing: a dead ReLU)
            sequence.check_example_major_rows(outputs, outs, 1, every_example=True)
        self._examples_checked.add(signature)

    def _full_or_diag_sees(self, capture: Capture, rows: int) -> bool:
        """Whether a covered module in full or diagonal shape sees the ``rows`` loss rows (its first dimension)."""
        approx = self._module_approx()
        return any(r.output.dim() and r.output.shape[0] == rows and approx.get(n) is not Approx.KFAC
                   for n, r in capture.records.items())

    def _check_reduce_layout(self, capture: Capture, outputs: Tensor, given: Tensor) -> None:
        """:func:`curvature.sequence.check_reduce_layout` once per shape signature (``outputs``: the loss
        rows, ``given``: the model's output before :func:`curvature.likelihoods.as_rows`)."""
        records = capture.records
        linear = {n: records[n].output for n, lay in self.layouts.items()
                  if n in records and self.approx[n] is Approx.KFAC and type(lay.family) is LinearFamily}
        positional = {n: r.output for n, r in records.items()
                      if isinstance(self._modules.get(n), (nn.Linear, nn.Embedding, nn.LayerNorm, nn.RMSNorm))}
        signature = ("reduce", tuple(given.shape), tuple((n, tuple(o.shape)) for n, o in linear.items()),
                     tuple(tuple(o.shape) for o in positional.values()))
        if not linear or signature in self._examples_checked:
            return
        examples = given.shape[0] if given.shape[0] != outputs.shape[0] else None
        with capture.frozen.on():
            sequence.check_reduce_layout(outputs, examples, linear, positional)
        self._examples_checked.add(signature)

    def _per_position_grad_chunks(self, capture: Capture, outputs: Tensor, vectors: Tensor,
                                  per_example: int) -> Iterator[Tuple[Dict[str, Tensor], Tensor]]:
        """:meth:`output_grad_chunks` of the ``K·T`` per-position vectors
        (:func:`curvature.sequence.per_position_vectors`), built and backpropagated a chunk at a time."""
        per_vector = sum(capture.records[n].output.numel() for n in self._modules)
        group = max(1, _GRAD_CHUNK_ELEMENTS // max(1, per_vector))
        for part, positions in sequence.per_position_vectors(vectors, per_example, group):
            done = 0
            for grads in self.output_grad_chunks(capture, outputs, part):
                k = next(iter(grads.values())).shape[0]
                yield grads, positions[done:done + k]  # the positions let blocks skip the sum over T
                done += k

    def _refuse_replaced(self, missing: List[str]) -> None:
        """ValueError for covered modules the forward did not call because they are no longer the model's:
        replaced (``model.head = nn.Linear(...)``, a transfer-learning head swap) or removed after the
        optimizer was built. The optimizer would keep the old module's curvature and parameters, and the new
        module's parameters are in no param group: it would never be trained."""
        gone = []
        for name in missing:
            try:
                now = self.model.get_submodule(name) if name else self.model
            except AttributeError:
                now = None
            if now is not self._modules[name]:
                gone.append(name)
        if gone:
            raise ValueError(
                f"covered modules {gone} are no longer the model's own (replaced or removed after the optimizer "
                "was built, e.g. model.head = nn.Linear(...)): the optimizer's curvature and param groups hold the "
                "old modules, and a new one's parameters would never be updated. Build a new optimizer after "
                "changing the model")

    def _refuse_uncalled(self, capture: Capture, missing: List[str]) -> None:
        """ValueError for covered modules the forward did not call with gradients enabled (or called on no
        rows)."""
        if not capture.records and contains_compiled(self.model):
            raise ValueError(compiled_before_hooks(f"covered modules {missing} were not recorded"))
        empty = [n for n in missing if n in capture.called_on_no_rows]
        if empty:
            raise ValueError(f"covered modules {empty} were called on no rows (e.g. a mixture-of-experts expert no "
                             "example was routed to), which the curvature cannot take: skip such a call "
                             "(`if rows.numel(): out = out.index_add(0, rows, expert(x[rows]))`)"
                             + ("; a module some batches do not call keeps its curvature from those that do"
                                if self.allow_uncalled else ""))
        skip = [f"^{re.escape(n)}$" for n in missing]
        raise ValueError(f"covered modules {missing} were not called in the forward pass (with gradients "
                         f"enabled); exclude them with skip_modules={skip!r} or freeze their parameters. The "
                         "curvature records module calls: a module whose parameters the forward uses without "
                         "calling it (F.linear(x, lin.weight), lin.forward(x), or a parent computing with them "
                         "itself, as nn.MultiheadAttention does with out_proj: skip the parent, its submodules are "
                         "skipped with it) or calls only inside torch.vmap / torch.func transforms is not seen; "
                         "call the module (lin(x)) outside such transforms to cover it. Reentrant activation "
                         "checkpointing (torch.utils.checkpoint(..., use_reentrant=True)) runs them under "
                         "torch.no_grad, which the curvature capture cannot see: use use_reentrant=False")

    def estimate_from_backward(self, capture: Capture, batch_size: Optional[int] = None,
                               loss_scale: Optional[float] = None) -> Dict[str, Block]:
        """Empirical-Fisher-type blocks from the gradients recorded during the user's backward.

        The recorded gradient of a loss averaged over ``R`` rows is ``Σ_r ∇ℓ_r / R``; it is
        multiplied by ``loss_scale`` (default ``R``) to recover the gradient of the summed loss,
        and the blocks are normalized by ``batch_size`` (default ``R``). ``R`` is the first dimension
        of the recorded root output (of the first covered module's output when there is none).
        """
        if not capture.records and self._modules and contains_compiled(self.model):
            raise ValueError(compiled_before_hooks(f"covered modules {list(self._modules)} were not recorded"))
        missing = [n for n in self._modules if n not in capture.records]
        if missing:
            self._refuse_replaced(missing)
            # a head this batch did not call keeps its running curvature (one process, as estimate()); one
            # called under no_grad, tied to a called module, or whose parameters the output depends on
            # without its call (a parent computing with them) cannot be estimated
            def used(name: str) -> bool:
                if name in capture.called_without_grad:
                    return True
                if capture.outputs:  # tied, or an output's graph (kept after backward) reaches its parameters
                    return not all(self._unused([name], out) for out in capture.outputs)
                return name not in self.layouts or any(p.grad is not None and bool(p.grad.ne(0).any())
                                                       for p in self.layouts[name].params)
            bad = missing if not self.allow_uncalled else [n for n in missing if used(n)]
            if bad:
                self._refuse_uncalled(capture, bad)
            with self.restricted_to(capture.records):
                return self.estimate_from_backward(capture, batch_size, loss_scale)
        self._refuse_unbatched_calls(capture.records)
        group = 1
        if capture.outputs:
            group = self.check_examples_align(capture.records,
                                              likelihoods.as_rows(self.loss, capture.outputs[0], None)[0])
        rows = (likelihoods.loss_rows(self.loss, capture.outputs[0]) if capture.outputs
                else next(iter(capture.records.values())).output.shape[0])
        s = float(loss_scale if loss_scale is not None else rows)
        if capture.records and not any(rec.backward_grads for rec in capture.records.values()):
            raise RuntimeError(f"no gradient was recorded for modules {list(capture.records)}; call backward() "
                               "inside the closure")
        grads = {}
        for name, rec in capture.records.items():
            # a module the backward did not reach (frozen since construction, an unused branch) has zero
            # output gradients, as the engine's own backward passes give it
            grads[name] = _scaled_sum(rec.backward_grads, s).unsqueeze(0) if rec.backward_grads else \
                rec.output.new_zeros((1,) + tuple(rec.output.shape))
        return self.blocks_from_grads(capture.records, grads, rows if batch_size is None else batch_size,
                                      group_rows=group)

    def _refuse_unbatched_calls(self, records: Dict[str, ModuleRecord]) -> None:
        """ValueError for a covered module whose family needs a batch dimension (a convolution's output is
        ``[N, C, *positions]``) called without one (an unbatched ``[C, L]`` / ``[C, H, W]`` input): its first
        dimension would be taken as the examples. The Hessian differentiates the loss itself and needs none."""
        unbatched = {}
        for name, rec in records.items():
            if name not in self._modules:
                continue
            mod = self._modules[name]
            fam = self.layouts[name].family if name in self.layouts else family_of(mod)  # (a tied use: its own)
            need = fam.batched_output_dim(mod) if fam is not None else None
            if need is not None and rec.output.dim() < need:
                unbatched[name] = list(rec.output.shape)
        if unbatched:
            names = {type(self._modules[n]).__name__ for n in unbatched}
            raise ValueError(
                f"covered {'/'.join(sorted(names))} modules {unbatched} were called without a batch dimension (an "
                "unbatched input): the curvature takes a layer's first dimension as the examples. Call them on "
                "the batch (x.unsqueeze(0) for one example), skip them with skip_modules, or use kind='hessian'")

    def check_examples_align(self, records: Dict[str, ModuleRecord], outputs: Tensor) -> int:
        """How many loss rows each covered module example holds (``T``, see :mod:`curvature.sequence`).

        The exact and the empirical Fisher are sums over examples of per-example products, taken at
        each covered module's batch dimension. A sequence model whose ``[N, T, C]`` logits are
        reshaped to ``[N·T, C]`` has N module examples of T rows each: the exact Fisher then
        backpropagates its vectors per position (no products of a T-row sum), the empirical Fisher
        takes the sequence's gradient as the per-example one. ValueError when the modules' batches do
        not divide the rows (:func:`curvature.sequence.rows_per_example`). The Monte-Carlo Fisher has
        no cross terms in expectation (independent zero-mean sampled gradients) and needs nothing.
        K-FAC blocks sum outer products of the output gradient at every position, the K-FAC-expand
        convention (Eschenhagen et al., 2023), normalized by the loss rows."""
        if self.kind in (Kind.FISHER, Kind.EMPIRICAL_FISHER):
            unbatched = {n: list(r.output.shape) for n, r in records.items() if r.output.dim() <= 1}
            if unbatched:
                raise ValueError(
                    f"kind={self.kind.value!r} sums per-example products, but covered modules {unbatched} were called "
                    "without a batch dimension (e.g. a Linear on a [d] vector whose output is broadcast over the "
                    "examples): their outputs have no per-example rows. Call them on the batch, skip them with "
                    "skip_modules, or use kind='fisher_mc'")
        batches = {n: r.output.shape[0] for n, r in records.items() if r.output.dim()}
        return sequence.rows_per_example(self.kind, outputs.shape[0], batches, self._module_approx())

    def _module_approx(self) -> Dict[str, Approx]:
        """The shape of every recorded module's block: a module using a tied parameter counts in the
        shape of the block holding it."""
        approx = {u.name: self.approx[lay.name] for lay in self.layouts.values() for u in lay.tied}
        approx.update(self.approx)
        return approx

    def output_grad_chunks(self, capture: Capture, outputs: Tensor, vectors: Tensor) -> Iterator[Dict[str, Tensor]]:
        """Gradients of ``<outputs, v_k>`` w.r.t. each module output, in chunks ``{module: [k, N, *out]}``
        over the ``K`` vectors: all at once from one vmapped backward when :attr:`batched_backward`
        (and vmap can batch the graph), else one backward per vector, stacked into chunks of at most
        :data:`_GRAD_CHUNK_ELEMENTS` elements (all of them for small models)."""
        names = list(self._modules)
        outs = [capture.records[n].output for n in names]
        if not all(o.requires_grad for o in outs):
            # a module whose output needs no gradient (its parameters were frozen after the engine was
            # built, and nothing before it is trained): its output gradients are zeros
            live = [i for i, o in enumerate(outs) if o.requires_grad]
            if not live:
                raise ValueError("no covered module's output requires a gradient: are all parameters frozen?")
            for chunk in self.output_grad_chunks_of(capture, outputs, vectors, [names[i] for i in live]):
                k = next(iter(chunk.values())).shape[0]
                yield {n: chunk[n] if n in chunk else outs[i].new_zeros((k,) + tuple(outs[i].shape))
                       for i, n in enumerate(names)}
            return
        yield from self.output_grad_chunks_of(capture, outputs, vectors, names)

    def output_grad_chunks_of(self, capture: Capture, outputs: Tensor, vectors: Tensor,
                              names: List[str]) -> Iterator[Dict[str, Tensor]]:
        """:meth:`output_grad_chunks` for the modules ``names`` (whose outputs require grad)."""
        outs = [capture.records[n].output for n in names]
        if vectors.shape[0] > 1 and self.batched_backward:
            with capture.frozen.on():  # BatchNorm batch statistics as constants (curvature.frozen_norm)
                batched = self._batched_output_grads(outputs, outs, vectors, names)
            if batched is not None:
                yield dict(zip(names, batched))
                return
        per_vector = sum(o.numel() for o in outs)
        group = max(1, min(vectors.shape[0], _GRAD_CHUNK_ELEMENTS // max(1, per_vector)))
        pending: List[List[Tensor]] = []
        for k in range(vectors.shape[0]):
            with capture.frozen.on():
                g = torch.autograd.grad(outputs, outs, grad_outputs=vectors[k].to(outputs.dtype),
                                        retain_graph=True, allow_unused=True)
            if k == 0:
                _check_reached(g, names)
            pending.append([gi if gi is not None else torch.zeros_like(o) for gi, o in zip(g, outs)])
            if len(pending) == group or k == vectors.shape[0] - 1:
                # a chunk of one vector (fisher_mc with one sample, empirical Fisher) is a view, not a copy
                yield {n: pending[0][i].unsqueeze(0) if len(pending) == 1 else torch.stack([p[i] for p in pending])
                       for i, n in enumerate(names)}
                pending = []

    @staticmethod
    def _batched_output_grads(outputs: Tensor, outs: List[Tensor], vectors: Tensor,
                              names: Optional[Sequence[str]] = None) -> Optional[List[Tensor]]:
        """All K backward passes as one vmapped backward (``is_grads_batched``), as BackPACK
        backpropagates the K columns of √H together; None when some op of the graph has no
        batching rule (the caller then loops over the K vectors)."""
        try:  # (vmap's "falling back to a slow path" warnings are off unless the user turned them on:
            # torch._C._debug_only_display_vmap_fallback_warnings; no catch_warnings here, whose exit at every
            # curvature step would reset Python's once-per-location warning registry for the user's warnings)
            g = torch.autograd.grad(outputs, outs, grad_outputs=vectors.to(outputs.dtype), retain_graph=True,
                                    allow_unused=True, is_grads_batched=True)
        except RuntimeError as err:  # an op without a batching rule, or an in-place op under vmap
            logger.debug("batched backward unavailable (%s); looping over %d vectors", err, vectors.shape[0])
            return None
        _check_reached(g, names if names is not None else [f"#{i}" for i in range(len(outs))])
        k = vectors.shape[0]
        return [gi if gi is not None else o.new_zeros((k,) + tuple(o.shape)) for gi, o in zip(g, outs)]

    def blocks_from_grads(self, records: Dict[str, ModuleRecord], grads: Dict[str, Tensor],
                          batch_size: int, group_rows: int = 1) -> Dict[str, Block]:
        """Per-module blocks from recorded inputs and output gradients ``[K, N, *out]``."""
        return self.blocks_from_grad_chunks(records, [grads], batch_size, group_rows)

    def blocks_from_grad_chunks(self, records: Dict[str, ModuleRecord], chunks: Iterable[Any],
                                batch_size: int, group_rows: int = 1) -> Dict[str, Block]:
        """Per-module blocks from output gradients that arrive in chunks ``{module: [k, N, *out]}``
        of the ``K`` backpropagated vectors (or ``(chunk, positions [k])`` for per-position vectors:
        :func:`curvature.sequence.localized`).

        Every Fisher-type block is a sum over the K vectors (``G`` of K-FAC, the diagonal, the
        full block), so each chunk adds its part and is dropped: the ``[K, N, *out]`` gradients
        of all modules never exist at once (no stacking copy, K× less memory). Layer inputs in
        normal form and K-FAC's input-side factor are computed once, from the first chunk.
        """
        refuse_swapped_parameters(records, self.layouts)
        inputs: Dict[str, Tensor] = {}
        sums: Dict[Any, List[Tensor]] = {}  # key: module name, or (module name, i) for its i-th tied use
        module_batch: Dict[Any, int] = {}
        input_rows: Dict[Any, Any] = {}  # the rows K-FAC's A of a module is a mean over (a number or 0-dim tensor)

        def normal_input(name: str, dt: torch.dtype) -> Tensor:
            if name not in inputs:
                mod, rec = self._modules[name], records[name]
                fam = self.layouts[name].family if name in self.layouts else family_of(mod)
                a = fam.normal_input(mod, rec.inputs, rec.output)
                inputs[name] = a.to(dt) if a.dtype.is_floating_point else a
            return inputs[name]

        reduce = self.kfac_approx is KFACApprox.REDUCE

        def add_kfac(key: Any, name: str, fam: Any, mod: nn.Module, names: Any, g: Tensor, dt: torch.dtype) -> None:
            module_batch[key] = g.shape[1]
            if reduce and isinstance(fam, WeightMatrixFamily):  # K-FAC-reduce: Σ_t g, mean_t a per example
                input_rows[key] = g.shape[1]
                g = g.sum(dim=2, keepdim=True)
                if key not in sums:
                    a = normal_input(name, dt).mean(dim=1, keepdim=True)
                    sums[key] = list(fam.kfac_factors(mod, a, g, names))
                else:
                    sums[key][fam.kfac_names().index("G")] += fam.kfac_output_factor(mod, None, g, names)
                return
            if key not in sums:
                rec = records[name]
                input_rows[key] = fam.kfac_input_rows(mod, rec.inputs, g)  # the rows A is a mean over (N·T positions)
                sums[key] = list(fam.kfac_factors_from_inputs(mod, rec.inputs, rec.output, g, names))
            else:
                a = normal_input(name, dt) if fam.output_factor_needs_input else None
                sums[key][fam.kfac_names().index("G")] += fam.kfac_output_factor(mod, a, g, names)

        for item in chunks:
            # per-position vectors come with their positions (curvature.sequence.localized)
            grads, positions = item if isinstance(item, tuple) else (item, None)
            for name, lay in self.layouts.items():
                fam, mod = lay.family, lay.module
                g = fam.normal_output_grad(mod, grads[name].detach())
                dt = compute_dtype(g.dtype if g.dtype.is_floating_point else torch.float32)
                g = g.to(dt)
                shape = self.approx[name]
                use_grads = [u.family.normal_output_grad(u.module, grads[u.name].detach()).to(dt) for u in lay.tied]
                if shape is Approx.KFAC:
                    add_kfac(name, name, fam, mod, lay.param_names, g, dt)
                    for i, (u, gu) in enumerate(zip(lay.tied, use_grads)):
                        add_kfac((name, i), u.name, u.family, u.module, (u.param,), gu, dt)
                    continue
                if lay.tied:
                    uses = [(fam, mod, lay.param_names, normal_input(name, dt), g)] + \
                        [(u.family, u.module, (u.param,), normal_input(u.name, dt), gu)
                         for u, gu in zip(lay.tied, use_grads)]
                    part = tied_per_example_sum(lay, shape, uses, _EXAMPLE_CHUNK)
                else:
                    a = normal_input(name, dt)
                    local = None if positions is None else sequence.localized(a, g, positions)
                    # a module seeing the loss rows while the example is a group of them (group_rows > 1)
                    group = group_rows if group_rows > 1 and g.shape[1] == batch_size else 1
                    part = self._per_example_sum(lay, shape, *(local if local is not None else (a, g)), group=group)
                if name in sums:
                    sums[name][0] += part
                else:
                    sums[name] = [part]
        blocks: Dict[str, Block] = {}
        for name, lay in self.layouts.items():
            shape = self.approx[name]
            if shape is Approx.KFAC:
                per_use = []
                for key, fam in [(name, lay.family)] + [((name, i), u.family) for i, u in enumerate(lay.tied)]:
                    factors = sums[key]
                    if module_batch[key] != batch_size:  # G is a sum over every position of the module,
                        # divided by the loss rows (its families divide by their own batch, the same number
                        # unless one module example holds several loss rows, as in [N·T, C] sequence logits)
                        factors[fam.kfac_names().index("G")].mul_(module_batch[key] / batch_size)
                    per_use.append(factors)
                blocks[name] = KFACBlock(lay, *combine_kfac(per_use))
                # the rows its A averages (a routed module: part of the batch); a tied layout's left factor
                # sums the uses' factors of both kinds: not weighted by rows
                blocks[name].rows = None if lay.tied else input_rows[name]
            elif shape is Approx.DIAG:
                blocks[name] = DiagBlock(lay, sums[name][0].div_(batch_size))  # the sums are ours: in place
            else:
                blocks[name] = FullBlock(lay, sums[name][0].div_(batch_size))
        return blocks

    @staticmethod
    def _per_example_sum(lay: Layout, shape: Approx, a: Tensor, g: Tensor, group: int = 1) -> Tensor:
        """``Σ_{k,n}`` of the squared (diag, ``[P]``) or outer (full, ``[P, P]``) per-example gradients;
        with ``group > 1`` an example is ``group`` consecutive rows of ``a`` / ``g``, whose per-row
        gradients are summed first (the sequence of ``[N·T, C]`` logits under the empirical Fisher)."""
        if shape is Approx.DIAG and group == 1:
            fast = lay.family.diag_sum(lay.module, a, g, lay.param_names)
            if fast is not None:
                return fast
        total: Optional[Tensor] = None
        step = max(group, _EXAMPLE_CHUNK // group * group)
        for s in range(0, a.shape[0], step):
            pe = lay.family.per_example_grads(lay.module, a[s:s + step], g[:, s:s + step], lay.param_names)
            flat = flat_per_example(pe, lay.param_names)
            if group > 1:
                flat = flat.reshape(g.shape[0], -1, group, lay.numel).sum(2)
            flat = flat.reshape(-1, lay.numel)
            part = flat.pow(2).sum(0) if shape is Approx.DIAG else flat.t() @ flat
            total = part if total is None else total + part
        assert total is not None
        return total


def refuse_swapped_parameters(records: Dict[str, ModuleRecord], layouts: Dict[str, Any]) -> None:
    """ValueError when a covered module ran with tensors other than parameters in place of its
    covered parameters (``torch.func.functional_call(model, {"0.weight": 2 * W}, x)``, fast
    weights, a mask applied through a stateless call): its recorded inputs and output gradients are
    those of the swapped-in tensor, so a Fisher-type block would be the curvature of that tensor,
    not of the parameter the optimizer updates. A tensor at the call other than the module's own
    parameter when the capture began (``ModuleRecord.own_parameters``; a plain tensor or another
    ``nn.Parameter``, an EMA copy's) is such a swap; ``functional_call`` with the model's own
    parameters passes.
    (The dynamic check of :class:`curvature.uses.UseWindows` catches a computed swap on the models
    it watches; a plain ``nn.Sequential`` is not watched, ``curvature/uses_static.py``.) Records
    without their parameters (an attention's recomputed projections) are not checked."""
    for name, rec in records.items():
        lay = layouts.get(name)
        if lay is None or not rec.parameters:
            continue
        covered = set(lay.param_names)
        own = rec.own_parameters or tuple(lay.module._parameters.values())
        swapped = [f"{name}.{local}" for local, t, o in zip(lay.module._parameters, rec.parameters, own)
                   if local in covered and isinstance(t, Tensor) and t is not o]
        if swapped:
            raise ValueError(
                f"covered module {name!r} ({type(lay.module).__name__}) ran with other tensors in place of its "
                f"parameters {swapped} (torch.func.functional_call or torch.nn.utils.stateless swapped them in: "
                "fast weights, a masked or rescaled weight): its Fisher-type curvature would be that of those "
                "tensors, not of the parameters the optimizer updates. Call the model with its own parameters, "
                f"or leave the module to the plain update with skip_modules=[{'^' + name + '$'!r}]")
