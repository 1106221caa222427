"""KFACPreconditioner under faults: non-finite batches, divergence, resume, bad checkpoints, dropped objects.

* ``on_nonfinite``: a NaN/inf batch is a no-op for the preconditioner (factors, decompositions,
  counters and gradients bit-identical), training afterwards equals training without that batch;
* ``max_consecutive_skips``: a diverged run raises instead of stalling;
* ``state_dict`` with decompositions: resume is bit-exact for any cadence; kfac_pytorch's
  factors-only format still loads;
* ``load_state_dict`` validates everything first and changes nothing when it refuses;
* hooks do not keep a dropped preconditioner alive.
"""
from __future__ import annotations

import copy
import gc
import io
import logging
import sys
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvature.linalg import LinalgError
from curvature.linalg.torch_backend import TorchBackend
from torchsso2 import NonFiniteError
from torchsso2.kfac import KFACPreconditioner

sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
import kfac_nonfinite_worker  # noqa: E402  (gloo rank of the two-rank test)
from dist_utils import run_gloo_ranks, start_ranks  # noqa: E402

DT = torch.float64


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1, stride=2)
        self.fc1 = nn.Linear(27, 6)
        self.fc2 = nn.Linear(6, 3, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def build(seed: int = 0, dtype: torch.dtype = DT) -> nn.Module:
    torch.manual_seed(seed)
    return Net().to(dtype)


def batch(seed: int, n: int = 6, dtype: torch.dtype = DT) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(n, 2, 5, 5, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


def poisoned(seed: int, value: float = float("nan")) -> Tuple[Tensor, Tensor]:
    x, y = batch(seed)
    x[0, 0, 1, 1] = value
    return x, y


def bits(t: Optional[Tensor]) -> Any:
    """Bit pattern of a tensor (NaN-safe equality)."""
    return None if t is None else (t.dtype, tuple(t.shape), t.detach().contiguous().view(torch.uint8).clone())


def same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is b
    return a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def snapshot(pre: KFACPreconditioner, model: nn.Module, grads: bool = True) -> Dict[str, Any]:
    """Everything a step could change: counters, factors, decompositions, parameters, gradients."""
    snap: Dict[str, Any] = {"steps": pre.steps, "mini": dict(pre._mini_steps), "updated": set(pre._updated)}
    for name, layer in pre.layers.items():
        snap[f"{name}.A"], snap[f"{name}.G"] = bits(layer.a_factor), bits(layer.g_factor)
        snap[f"{name}.ready"] = layer.inv_ready
        for k, v in layer.inv.items():
            snap[f"{name}.inv.{k}"] = bits(v)
    for n, p in model.named_parameters():
        snap[f"param.{n}"] = bits(p)
        if grads:
            snap[f"grad.{n}"] = bits(p.grad)
    return snap


def assert_same(a: Dict[str, Any], b: Dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], tuple) or a[k] is None:
            assert same(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def train_step(model: nn.Module, pre: KFACPreconditioner, opt: torch.optim.Optimizer,
               micro: List[Tuple[Tensor, Tensor]]) -> None:
    opt.zero_grad()
    for x, y in micro:
        (F.cross_entropy(model(x), y) / len(micro)).backward()
    pre.step()
    if not getattr(pre, "last_step_skipped", False):  # kfac_pytorch's has no such attribute
        opt.step()


# ---------------------------------------------------------------------------- on_nonfinite
@pytest.mark.parametrize("in_hook", [True, False])
@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("at", [0, 3])
def test_nonfinite_batch_is_skipped_and_training_equals_training_without_it(in_hook, micro, method, value, at,
                                                                             caplog):
    kw = dict(update_factors_in_hook=in_hook, accumulation_steps=micro, compute_method=method,
              factor_update_steps=1, inv_update_steps=2, damping=0.01, inv_dtype=DT)
    clean = [[batch(10 * s + k) for k in range(micro)] for s in range(5)]
    bad = [poisoned(99, value)] + [batch(98 + k) for k in range(1, micro)]  # the bad micro-batch comes first

    model_a, model_b = build(), build()
    pre_a, pre_b = KFACPreconditioner(model_a, **kw), KFACPreconditioner(model_b, **kw)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        if step == at:  # the non-finite batch, seen only by run a
            state_before = snapshot(pre_a, model_a, grads=False)
            opt_a.zero_grad()
            for x, y in bad:
                (F.cross_entropy(model_a(x), y) / micro).backward()
            grads_before = {n: bits(p.grad) for n, p in model_a.named_parameters()}
            with caplog.at_level(logging.WARNING, logger="torchsso2.kfac.nonfinite"):
                pre_a.step()
            assert pre_a.last_step_skipped and pre_a.num_skipped == 1 and pre_a.consecutive_skips == 1
            assert "skipped" in caplog.text and "conv.weight.grad" in caplog.text
            # factors (the hooks' fold undone), decompositions, counters as before the batch
            assert_same(snapshot(pre_a, model_a, grads=False), state_before)
            assert all(same(bits(p.grad), grads_before[n]) for n, p in model_a.named_parameters())
        train_step(model_a, pre_a, opt_a, clean[step])
        train_step(model_b, pre_b, opt_b, clean[step])
        assert not pre_a.last_step_skipped and pre_a.consecutive_skips == 0
    assert pre_a.num_skipped == 1 and pre_b.num_skipped == 0
    snap_a, snap_b = snapshot(pre_a, model_a), snapshot(pre_b, model_b)
    assert_same(snap_a, snap_b)
    assert all(torch.isfinite(p).all() for p in model_a.parameters())


@pytest.mark.parametrize("in_hook", [True, False])
def test_nan_that_reached_a_factor_through_an_earlier_hook_is_discarded(in_hook):
    """The user drops a NaN micro-batch's gradients but its factor contribution was already
    recorded by the hooks: the step is skipped and the NaN is not folded into the factors."""
    kw = dict(update_factors_in_hook=in_hook, accumulation_steps=2, damping=0.01, inv_dtype=DT)
    model, ref_model = build(), build()
    pre, ref = KFACPreconditioner(model, **kw), KFACPreconditioner(ref_model, **kw)
    for p in (pre, ref):
        m = model if p is pre else ref_model
        for k in range(2):
            F.cross_entropy(m(batch(k)[0]), batch(k)[1]).backward()
        p.step()
    before = {n: (l.a_factor, l.g_factor) for n, l in pre.layers.items()}
    model.zero_grad()
    F.cross_entropy(model(poisoned(5)[0]), poisoned(5)[1]).backward()
    model.zero_grad()  # the gradients are clean again, the hooks' batch is not
    F.cross_entropy(model(batch(6)[0]), batch(6)[1]).backward()
    pre.step()
    assert pre.last_step_skipped and pre.steps == 1
    for n, layer in pre.layers.items():
        assert layer.a_factor is before[n][0] and layer.g_factor is before[n][1], n
        assert layer.a_batch is None and torch.isfinite(layer.a_factor).all()
        assert torch.equal(layer.a_factor, ref.layers[n].a_factor)
    # the next normal step is the reference's next step
    for p, m in ((pre, model), (ref, ref_model)):
        m.zero_grad()
        for k in (7, 8):
            F.cross_entropy(m(batch(k)[0]), batch(k)[1]).backward()
        p.step()
    for n in pre.layers:
        assert torch.equal(pre.layers[n].a_factor, ref.layers[n].a_factor)
        assert torch.equal(pre.layers[n].inv["qa"], ref.layers[n].inv["qa"])
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_on_nonfinite_raise_names_the_value_and_changes_nothing():
    model = build()
    pre = KFACPreconditioner(model, on_nonfinite="raise", damping=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, pre, opt, [batch(0)])
    before = snapshot(pre, model, grads=False)
    model.zero_grad()
    F.cross_entropy(model(poisoned(1)[0]), poisoned(1)[1]).backward()
    raw = {n: bits(p.grad) for n, p in model.named_parameters()}
    with pytest.raises(NonFiniteError, match=r"non-finite .*conv\.weight\.grad.*on_nonfinite='raise'"):
        pre.step()
    assert_same(snapshot(pre, model, grads=False), before)
    assert all(same(bits(p.grad), raw[n]) for n, p in model.named_parameters())
    assert pre.num_skipped == 0
    train_step(model, pre, opt, [batch(2)])  # and it goes on
    assert pre.steps == 2


def test_max_consecutive_skips_raises_with_advice_and_a_good_step_resets_the_count():
    model = build()
    pre = KFACPreconditioner(model, max_consecutive_skips=3, damping=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            train_step(model, pre, opt, [poisoned(1)])
        train_step(model, pre, opt, [batch(0)])
        assert pre.consecutive_skips == 0 and pre.num_skipped == 2
        for _ in range(2):
            train_step(model, pre, opt, [poisoned(1)])
        with pytest.raises(NonFiniteError, match=r"3 consecutive steps were skipped.*lower the learning rate.*damping"):
            train_step(model, pre, opt, [poisoned(1)])
    assert pre.steps == 1


def test_max_consecutive_skips_none_never_raises():
    model = build()
    pre = KFACPreconditioner(model, max_consecutive_skips=None)
    assert pre.max_consecutive_skips is None and pre.on_nonfinite == "skip"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logging.getLogger("torchsso2.kfac.nonfinite").disabled = True
    try:
        for _ in range(25):
            train_step(model, pre, opt, [poisoned(1)])
    finally:
        logging.getLogger("torchsso2.kfac.nonfinite").disabled = False
    assert pre.num_skipped == 25 and pre.steps == 0
    assert KFACPreconditioner(build()).max_consecutive_skips == 20


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(on_nonfinite="ignore"), ValueError, "on_nonfinite must be 'skip' or 'raise', got 'ignore'"),
    (dict(on_nonfinite=None), TypeError, "on_nonfinite must be 'skip' or 'raise'"),
    (dict(max_consecutive_skips=0), ValueError, "max_consecutive_skips must be an int >= 1 or None"),
    (dict(max_consecutive_skips=2.5), TypeError, "max_consecutive_skips must be an int >= 1 or None"),
])
def test_bad_nonfinite_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        KFACPreconditioner(build(), **kwargs)


class FlakyBackend(TorchBackend):
    """torch.linalg, but while ``mode`` is set every eigh / damped inverse fails: ``"raise"``
    (LinalgError, as a non-converging float32 eigh) or ``"nan"`` (NaN results, no error)."""

    def __init__(self) -> None:
        self.mode: Optional[str] = None

    def _eigh(self, a: Tensor) -> Tuple[Tensor, Tensor]:
        if self.mode == "raise":
            raise LinalgError("eigh (flaky backend) did not converge")
        evals, evecs = super()._eigh(a)
        return (evals * float("nan"), evecs) if self.mode == "nan" else (evals, evecs)

    def damped_inv(self, a: Tensor, damping: float, dtype: Optional[torch.dtype] = None) -> Tensor:
        if self.mode == "raise":
            raise LinalgError("damped_inv (flaky backend): not positive definite")
        out = super().damped_inv(a, damping, dtype=dtype)
        return out * float("nan") if self.mode == "nan" else out


@pytest.mark.parametrize("mode", ["raise", "nan"])
@pytest.mark.parametrize("method", ["eigen", "inverse"])
def test_failed_decomposition_skips_the_step_and_keeps_the_previous_decompositions(mode, method, caplog):
    """A decomposition that raises LinalgError or returns NaN from finite factors: the step is
    skipped, the previous decompositions and factors are put back, the next steps equal a run
    that never saw that batch."""
    kw = dict(compute_method=method, damping=0.01, inv_update_steps=1, inv_dtype=DT)
    flaky = FlakyBackend()
    model_a, model_b = build(), build()
    pre_a, pre_b = KFACPreconditioner(model_a, linalg=flaky, **kw), KFACPreconditioner(model_b, **kw)
    opt_a = torch.optim.SGD(model_a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
    for step in range(5):
        if step == 2:
            state_before = snapshot(pre_a, model_a, grads=False)
            held = {n: dict(l.inv) for n, l in pre_a.layers.items()}
            opt_a.zero_grad()
            F.cross_entropy(model_a(batch(77)[0]), batch(77)[1]).backward()
            raw = {n: bits(p.grad) for n, p in model_a.named_parameters()}
            flaky.mode = mode
            with caplog.at_level(logging.WARNING):
                pre_a.step()
            flaky.mode = None
            assert pre_a.last_step_skipped and pre_a.num_skipped == 1
            # the advice fits the run: its inverses are float64 already, so more damping, not float64
            assert "preconditioned gradient" in caplog.text and "try more damping" in caplog.text
            assert "inv_dtype=torch.float64" not in caplog.text
            if mode == "raise":
                assert "did not converge" in caplog.text or "not positive definite" in caplog.text
            assert_same(snapshot(pre_a, model_a, grads=False), state_before)
            assert all(same(bits(p.grad), raw[n]) for n, p in model_a.named_parameters())
            for n, layer in pre_a.layers.items():
                assert all(layer.inv[k] is v for k, v in held[n].items()) and set(layer.inv) == set(held[n])
        train_step(model_a, pre_a, opt_a, [batch(step)])
        train_step(model_b, pre_b, opt_b, [batch(step)])
    assert_same(snapshot(pre_a, model_a), snapshot(pre_b, model_b))


def test_failed_decomposition_under_raise_names_the_layer_and_the_fix():
    flaky = FlakyBackend()
    model = build()
    pre = KFACPreconditioner(model, linalg=flaky, on_nonfinite="raise", damping=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, pre, opt, [batch(0)])
    flaky.mode = "raise"
    # the decomposition is retried in float64 (then with jitter) before it fails (curvature/linalg/eigh_retry.py)
    with pytest.raises(NonFiniteError, match=r"conv preconditioned gradient \(factor A: eigh .* failed in every attempt "
                                             r"\(.*eigh \(flaky backend\) did not converge.*try inv_dtype=torch.float64 "
                                             r"or more damping\)"):
        train_step(model, pre, opt, [batch(1)])
    assert pre.steps == 1


# ---------------------------------------------------------------------------- resume
def _run(model: nn.Module, pre: KFACPreconditioner, steps: range) -> List[Dict[str, Tensor]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for s in steps:
        train_step(model, pre, opt, [batch(s, dtype=next(model.parameters()).dtype)])
        out.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def _checkpoint(model: nn.Module, pre: KFACPreconditioner, **kw: Any) -> Dict[str, Any]:
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "kfac": pre.state_dict(**kw)}, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.filterwarnings("ignore:It is suggested that inv_update_steps")
@pytest.mark.parametrize("method,prediv", [("eigen", True), ("eigen", False), ("inverse", True)])
@pytest.mark.parametrize("dtype", [torch.float32, DT])
def test_resume_is_bit_exact_with_decompositions(method, prediv, dtype):
    """factor_update_steps=2, inv_update_steps=3, checkpoint after step 5: the decompositions in
    use (step 3) are older than the saved factors (step 4), so only saving them resumes exactly."""
    kw = dict(factor_update_steps=2, inv_update_steps=3, damping=0.01, compute_method=method,
              compute_eigenvalue_outer_product=prediv)
    model = build(dtype=dtype)
    pre = KFACPreconditioner(model, **kw)
    _run(model, pre, range(5))
    ckpt = _checkpoint(model, pre)
    light = _checkpoint(model, pre, include_decompositions=False)
    ext = ckpt["kfac"]["torchsso2"]
    assert set(ext["decompositions"]) == set(pre.layers) and ext["inv_ready"]
    assert set(light["kfac"]) == {"steps", "factor_update_steps", "inv_update_steps", "damping", "factor_decay",
                                  "kl_clip", "lr", "layers"}  # exactly kfac_pytorch's keys
    straight = _run(model, pre, range(5, 9))

    def resume(c: Dict[str, Any]) -> List[Dict[str, Tensor]]:
        m = build(seed=7, dtype=dtype)
        m.load_state_dict(c["model"])
        p = KFACPreconditioner(m, compute_method=method, compute_eigenvalue_outer_product=prediv, damping=0.5)
        p.load_state_dict(c["kfac"])
        assert p.steps == 5 and p.damping == 0.01 and p.inv_update_steps == 3
        return _run(m, p, range(5, 9))

    resumed = resume(ckpt)
    for a, b in zip(straight, resumed):
        for n in a:
            assert torch.equal(a[n], b[n]), n
    # recomputing the decompositions from the saved factors (kfac_pytorch's way) is not exact here
    recomputed = resume(light)
    assert any(not torch.equal(a[n], b[n]) for a, b in zip(straight, recomputed) for n in a)


def test_loads_kfac_pytorch_state_dict_and_kfac_pytorch_loads_ours():
    kfac = pytest.importorskip("kfac.preconditioner")
    model = build(dtype=torch.float32)
    ours_model = copy.deepcopy(model)
    ours = KFACPreconditioner(ours_model, damping=0.01, inv_update_steps=2)
    _run(ours_model, ours, range(3))
    sd = ours.state_dict()
    # kfac_pytorch's format: steps, hyper-parameters, layers {name: {A, G}}
    theirs_sd = {k: v for k, v in sd.items() if k != "torchsso2"}
    fresh = KFACPreconditioner(build(seed=3, dtype=torch.float32), damping=0.5)
    fresh.load_state_dict(theirs_sd)
    assert fresh.steps == 3 and fresh.damping == 0.01
    for n, layer in fresh.layers.items():
        assert torch.equal(layer.a_factor, ours.layers[n].a_factor)
        assert layer.inv_ready and torch.isfinite(layer.inv["qa"]).all()
    # a real kfac_pytorch state dict (after its own steps) loads too
    tmodel = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = kfac.KFACPreconditioner(tmodel, damping=0.01, inv_update_steps=2)
        _run(tmodel, theirs, range(3))
    real = theirs.state_dict()
    fresh.load_state_dict(real)
    for n, layer in fresh.layers.items():
        assert torch.equal(layer.a_factor, real["layers"][n]["A"])
    # and kfac_pytorch loads ours (it ignores the extra keys)
    theirs.load_state_dict(copy.deepcopy(sd))
    assert theirs.steps == 3


def test_decompositions_missing_for_a_ready_layer_are_computed_locally():
    """A checkpoint from a rank that did not hold a layer's decompositions (MEM_OPT/HYBRID_OPT):
    the loading rank decomposes that layer from the saved factors, as a kfac_pytorch-format load would."""
    model = build()
    pre = KFACPreconditioner(model, damping=0.01)
    _run(model, pre, range(3))
    sd = copy.deepcopy(pre.state_dict())
    del sd["torchsso2"]["decompositions"]["fc1"]
    light = copy.deepcopy(pre.state_dict(include_decompositions=False))
    a, b = KFACPreconditioner(build(seed=1), damping=0.01), KFACPreconditioner(build(seed=1), damping=0.01)
    a.load_state_dict(sd)
    b.load_state_dict(light)
    assert a.layers["fc1"].inv_ready and set(a.layers["fc1"].inv) == {"qa", "qg", "dgda"}
    for k, v in b.layers["fc1"].inv.items():
        assert torch.equal(a.layers["fc1"].inv[k], v), k
    for k, v in pre.layers["conv"].inv.items():  # the others come from the checkpoint as they were
        assert torch.equal(a.layers["conv"].inv[k], v), k


# ---------------------------------------------------------------------------- load_state_dict refusals
def _trained() -> Tuple[nn.Module, KFACPreconditioner]:
    model = build()
    pre = KFACPreconditioner(model, damping=0.01, factor_update_steps=1, inv_update_steps=1)
    _run(model, pre, range(2))
    return model, pre


def _set(path: Tuple[Any, ...], value: Any) -> Callable[[Dict[str, Any]], None]:
    def edit(sd: Dict[str, Any]) -> None:
        d = sd
        for k in path[:-1]:
            d = d[k]
        if value is KeyError:
            del d[path[-1]]
        else:
            d[path[-1]] = value(d[path[-1]]) if callable(value) else value
    return edit


REFUSALS = [
    ("not a dict", lambda sd: None, "state_dict must be a dict"),
    ("no steps", _set(("steps",), KeyError), "has no 'steps' key"),
    ("unknown key", _set(("momentum",), 0.9), "unexpected keys ['momentum']"),
    ("steps negative", _set(("steps",), -1), "state_dict['steps'] must be an int >= 0"),
    ("steps str", _set(("steps",), "3"), "state_dict['steps'] must be an int >= 0"),
    ("damping", _set(("damping",), -1.0), "state_dict['damping'] is invalid"),
    ("counter", _set(("torchsso2", "num_skipped"), -2), "state_dict['torchsso2']['num_skipped'] must be an int >= 0"),
    ("extension key", _set(("torchsso2", "extra"), 1), "state_dict['torchsso2'] has unexpected keys ['extra']"),
    ("extension type", _set(("torchsso2",), [1]), "state_dict['torchsso2'] must be a dict"),
    ("layer missing", _set(("layers", "fc2"), KeyError), "missing ['fc2']"),
    ("layer extra", _set(("layers", "fc9"), {"A": None, "G": None}), "unexpected ['fc9']"),
    ("layer key extra", _set(("layers", "fc1", "B"), None), "state_dict['layers']['fc1'] must have exactly"),
    ("factor shape", _set(("layers", "fc1", "A"), lambda t: t[:-1, :-1]),
     "state_dict['layers']['fc1']['A'] has shape (27, 27), the registered layer needs (28, 28)"),
    ("factor dtype", _set(("layers", "fc1", "G"), lambda t: t.to(torch.int64)),
     "state_dict['layers']['fc1']['G'] has dtype torch.int64"),
    ("factor nan", _set(("layers", "conv", "G"), lambda t: t * float("nan")),
     "state_dict['layers']['conv']['G'] holds NaN/inf"),
    ("factor not tensor", _set(("layers", "conv", "A"), [[1.0]]), "must be a tensor of shape (19, 19)"),
    ("decomposition shape", _set(("torchsso2", "decompositions", "fc2", "qg"), lambda t: t[:2, :2]),
     "state_dict['torchsso2']['decompositions']['fc2']['qg'] has shape (2, 2)"),
    ("decomposition dtype", _set(("torchsso2", "decompositions", "fc2", "qa"), lambda t: t.double()),
     "state_dict['torchsso2']['decompositions']['fc2']['qa'] has dtype torch.float64, the preconditioner stores "
     "torch.float32"),
    ("decomposition nan", _set(("torchsso2", "decompositions", "fc1", "dgda"), lambda t: t / 0.0 * 0.0),
     "state_dict['torchsso2']['decompositions']['fc1']['dgda'] holds NaN/inf"),
    ("decomposition key", _set(("torchsso2", "decompositions", "fc1", "qg"), KeyError),
     "state_dict['torchsso2']['decompositions']['fc1'] must have exactly the keys ['dgda', 'qa', 'qg']"),
    ("decomposition layer", _set(("torchsso2", "decompositions", "fc7"), {}), "unexpected ['fc7']"),
    ("inv_ready name", _set(("torchsso2", "inv_ready"), ["conv", "fc5"]),
     "state_dict['torchsso2']['inv_ready'] must be a list of registered"),
    ("decompositions alone", _set(("torchsso2", "inv_ready"), KeyError),
     "must have both 'decompositions' and 'inv_ready'"),
]


@pytest.mark.parametrize("what,edit,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_load_state_dict_refuses_and_changes_nothing(what, edit, message):
    model, pre = _trained()
    good = copy.deepcopy(pre.state_dict())
    bad = copy.deepcopy(good)
    result = edit(bad)
    if what == "not a dict":
        bad = [("steps", 1)]
    assert result is None
    target_model, target = _trained()
    _run(target_model, target, range(2, 3))  # a different state than the checkpoint's
    before = snapshot(target, target_model)
    handles = {n: (l.a_factor, l.g_factor, dict(l.inv)) for n, l in target.layers.items()}
    with pytest.raises(TypeError if what == "not a dict" else ValueError) as info:  # (optimizers: TypeError too)
        target.load_state_dict(bad)
    assert message in str(info.value), str(info.value)
    assert_same(snapshot(target, target_model), before)
    assert target.damping == 0.01 and target.steps == 3 and target.num_skipped == 0
    for n, layer in target.layers.items():
        assert layer.a_factor is handles[n][0] and layer.g_factor is handles[n][1]
        assert all(layer.inv[k] is v for k, v in handles[n][2].items())
    target.load_state_dict(good)  # the good one still loads
    assert target.steps == 2


# ---------------------------------------------------------------------------- hooks lifetime
def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def test_dropped_preconditioners_leave_no_hooks_and_are_not_kept_alive():
    model = build()
    x, y = batch(0)
    refs = []
    for _ in range(200):
        pre = KFACPreconditioner(model)
        refs.append(weakref.ref(pre))
        F.cross_entropy(model(x), y).backward()  # a pending tensor hook must not keep it either
        pre.step()
    del pre
    gc.collect()
    assert all(r() is None for r in refs)
    assert _hook_count(model) == 0
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()  # forward/backward still work
    assert all(p.grad is not None for p in model.parameters())
    live = KFACPreconditioner(model)
    assert _hook_count(model) == 3 + 1  # one per layer, and the model's (it counts the micro-batches)
    F.cross_entropy(model(x), y).backward()
    live.step()
    assert live.steps == 1 and live.layers["fc1"].has_factors()
    live.remove_hooks()
    assert _hook_count(model) == 0
    del live
    gc.collect()
    assert _hook_count(model) == 0


# ---------------------------------------------------------------------------- two ranks
def test_fault_on_one_rank_is_skipped_on_every_rank(tmp_path):
    """gloo, DDP, 2 ranks: a batch that is NaN on rank 1 only, or a step whose decompositions
    fail on rank 0 only, is skipped by both ranks (no hang, MEM_OPT broadcasts included) and the
    run equals one that never saw that batch."""
    codes = run_gloo_ranks(kfac_nonfinite_worker, 2, tmp_path, 120.0)
    assert codes == [0, 0], f"gloo ranks exited with {codes} (None: killed after 120 s)"
    ranks = [torch.load(tmp_path / f"nonfinite_rank{r}.pt") for r in range(2)]
    for name in ranks[0]:
        for r in range(2):
            nan, clean = ranks[r][name]["nan"], ranks[r][name]["clean"]
            assert nan["num_skipped"] == 1 and clean["num_skipped"] == 0, (name, r)
            assert nan["steps"] == clean["steps"] == kfac_nonfinite_worker.STEPS - 1, (name, r)
            assert torch.equal(nan["params"], clean["params"]), (name, r)
            assert torch.isfinite(nan["params"]).all()
        assert torch.equal(ranks[0][name]["nan"]["params"], ranks[1][name]["nan"]["params"]), name


def test_two_rank_resume_is_bit_exact_from_each_ranks_own_checkpoint(tmp_path):
    """gloo, DDP, 2 ranks, factor_update_steps=2, inv_update_steps=3, checkpoint after step 5:
    each rank resuming from its own state_dict follows the uninterrupted run bit for bit
    (COMM_OPT, MEM_OPT eigen/inverse); every rank loading rank 0's (MEM_OPT: it lacks the
    decompositions rank 1 held, which rank 1 then computes from the saved factors) runs on
    without a hang, finite, equal on COMM_OPT."""
    codes = start_ranks(kfac_nonfinite_worker.resume_main, 2, (2, str(tmp_path / "init"), str(tmp_path)),
                        [kfac_nonfinite_worker.__name__], 120.0)
    assert codes == [0, 0], f"gloo ranks exited with {codes} (None: killed after 120 s)"
    ranks = [torch.load(tmp_path / f"resume_rank{r}.pt") for r in range(2)]
    for name in ranks[0]:
        for r in range(2):
            res = ranks[r][name]
            assert torch.equal(res["own"], res["straight"]), (name, r)
            assert torch.isfinite(res["rank0"]).all(), (name, r)
            if name.startswith("comm_opt"):
                assert torch.equal(res["rank0"], res["straight"]), (name, r)


def _dropped_batch_run(with_bad: bool, checkpoint: bool = False) -> Tuple[Tensor, List[bool]]:
    """SGD + KFACPreconditioner where the user drops a NaN batch on its loss without calling step()."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    pre = KFACPreconditioner(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 6, generator=g), torch.randint(0, 3, (32,), generator=g)) for _ in range(4)]
    skipped: List[bool] = []
    for i in ([0, 1, -1, 2, 3] if with_bad else [0, 1, 2, 3]):
        sgd.zero_grad()
        xb, yb = batches[max(i, 0)]
        if i < 0:
            xb = xb.clone()
            xb[0, 0] = float("nan")
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if not torch.isfinite(loss):  # dropped: no step
            if checkpoint:  # a checkpoint taken now loads, and holds the factors of the last step
                other = KFACPreconditioner(nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)))
                other.load_state_dict(pre.state_dict())
                for name, layer in pre.layers.items():
                    for t in other.layers[name].factors():
                        assert bool(torch.isfinite(t).all())
            continue
        pre.step()
        skipped.append(pre.last_step_skipped)
        if not pre.last_step_skipped:
            sgd.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]), skipped


@pytest.mark.parametrize("checkpoint", [False, True])
def test_a_batch_dropped_without_step_neither_spoils_the_checkpoint_nor_the_next_batch(checkpoint: bool) -> None:
    clean, _ = _dropped_batch_run(False)
    params, skipped = _dropped_batch_run(True, checkpoint)
    assert not any(skipped)  # the next good batch is not lost to the dropped one's NaN factors
    assert torch.equal(params, clean)
