"""kfac_pytorch 0.4.2 compatibility of ``torchsso2.kfac``: user-level scenarios.

The scenarios of kfac_pytorch's public tests (constructor validation and warnings, the
parameter scheduler, factor averaging, logging levels, enums, state dicts, training),
written against ``import torchsso2.kfac as kfac``. ``test_same_as_kfac_pytorch_*`` run the same
calls on both libraries when kfac_pytorch is installed (skipped otherwise).
"""
from __future__ import annotations

import enum
import inspect
import logging
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import torchsso2.kfac as kfac
from torchsso2.kfac.arguments import resolve_grad_worker_fraction
from torchsso2.kfac.base_preconditioner import BaseKFACPreconditioner
from torchsso2.kfac.enums import AllreduceMethod, AssignmentStrategy, ComputeMethod, DistributedStrategy
from torchsso2.kfac.hyperparams import exp_decay_factor_averaging
from torchsso2.kfac.preconditioner import KFACPreconditioner
from torchsso2.kfac.scheduler import LambdaParamScheduler
from dist_scripts.kfac_tiny import Tiny


def tiny(seed: int = 0, dtype: torch.dtype = torch.float32) -> Tiny:
    torch.manual_seed(seed)
    return Tiny().to(dtype)


# ---------------------------------------------------------------------------- the public surface
KFAC_PYTORCH_NAMES = {
    # module -> public names of kfac_pytorch 0.4.2 that a user reaches
    "enums": ["AllreduceMethod", "AssignmentStrategy", "ComputeMethod", "DistributedStrategy"],
    "preconditioner": ["KFACPreconditioner"],
    "base_preconditioner": ["BaseKFACPreconditioner"],
    "scheduler": ["LambdaParamScheduler"],
    "hyperparams": ["exp_decay_factor_averaging"],
    "warnings": ["ExperimentalFeatureWarning"],
}

KFAC_PYTORCH_ARGS = dict(  # KFACPreconditioner's keyword arguments and defaults in kfac_pytorch 0.4.2
    factor_update_steps=1, inv_update_steps=1, damping=0.001, factor_decay=0.95, kl_clip=0.001, lr=0.1,
    accumulation_steps=1, allreduce_bucket_cap_mb=25.0, assignment_strategy=AssignmentStrategy.COMPUTE,
    colocate_factors=True, compute_method=ComputeMethod.EIGEN, compute_eigenvalue_outer_product=True,
    grad_worker_fraction=DistributedStrategy.COMM_OPT, symmetry_aware=False, grad_scaler=None,
    factor_dtype=None, inv_dtype=torch.float32, skip_layers=None, update_factors_in_hook=True,
    loglevel=logging.DEBUG,
)


def test_module_layout_and_names():
    for module, names in KFAC_PYTORCH_NAMES.items():
        mod = getattr(kfac, module)
        for name in names:
            assert hasattr(mod, name), f"kfac.{module}.{name}"
    assert [m.name for m in AllreduceMethod] == ["ALLREDUCE", "ALLREDUCE_BUCKETED"]
    assert [(m.name, m.value) for m in DistributedStrategy] == [("COMM_OPT", 1), ("MEM_OPT", 2), ("HYBRID_OPT", 3)]
    assert issubclass(KFACPreconditioner, BaseKFACPreconditioner)


def test_constructor_arguments_and_defaults():
    params = inspect.signature(KFACPreconditioner).parameters
    for name, default in KFAC_PYTORCH_ARGS.items():
        assert name in params, name
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == default, name
    pre = KFACPreconditioner(tiny())
    for name in ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr"):
        assert getattr(pre, name) == KFAC_PYTORCH_ARGS[name]
    assert pre.steps == 0
    assert pre.allreduce_method is AllreduceMethod.ALLREDUCE_BUCKETED
    assert pre.tdc is pre.comm
    assert pre.skip_layers == [] and pre.grad_scaler is None and pre.factor_dtype is None
    assert pre.grad_worker_fraction == 1.0 and pre.distributed_strategy is DistributedStrategy.COMM_OPT
    assert KFACPreconditioner(tiny(), allreduce_bucket_cap_mb=0).allreduce_method is AllreduceMethod.ALLREDUCE
    text = repr(pre)
    for key in ("allreduce_method=AllreduceMethod.ALLREDUCE_BUCKETED", "assignment=", "loglevel=10", "layers=2"):
        assert key in text


# ---------------------------------------------------------------------------- constructor validation
def test_unknown_enum_names_are_key_and_value_errors():
    for kwargs in (dict(compute_method="svd"), dict(assignment_strategy="fastest")):
        with pytest.raises(KeyError):
            KFACPreconditioner(tiny(), **kwargs)
        with pytest.raises(ValueError, match="expected one of"):
            KFACPreconditioner(tiny(), **kwargs)
    try:
        KFACPreconditioner(tiny(), compute_method="svd")
    except KeyError as exc:  # printed as the message, not as a quoted key
        assert str(exc).startswith("compute_method='svd' is not valid")


def test_string_enums_and_flags_as_kfac_pytorch():
    assert KFACPreconditioner(tiny(), assignment_strategy="memory").assignment_strategy is AssignmentStrategy.MEMORY
    assert KFACPreconditioner(tiny(), compute_method="inverse").compute_method is ComputeMethod.INVERSE
    pre = KFACPreconditioner(tiny(), colocate_factors=1, symmetry_aware=0, update_factors_in_hook=1,
                             compute_eigenvalue_outer_product=1)
    assert pre.colocate_factors is True and pre.symmetry_aware is False and pre.update_factors_in_hook is True
    with pytest.raises(TypeError, match="colocate_factors must be a bool"):
        KFACPreconditioner(tiny(), colocate_factors="no")


def test_kl_clip_none_is_a_type_error_and_a_callable_may_return_none():
    with pytest.raises(TypeError, match=r"kl_clip.*got None.*lambda step: None"):
        KFACPreconditioner(tiny(), kl_clip=None)
    model, x = tiny(), torch.rand(8, 10)
    pre = KFACPreconditioner(model, kl_clip=lambda step: None)
    assert pre.kl_clip is None
    model(x).square().sum().backward()
    pre.step()
    assert pre.steps == 1


def test_validation_errors_as_kfac_pytorch():
    cases = [
        (dict(allreduce_bucket_cap_mb=-1), ValueError),
        (dict(compute_method=ComputeMethod.EIGEN, compute_eigenvalue_outer_product=True, colocate_factors=False),
         ValueError),
        (dict(grad_worker_fraction=2), ValueError),
        (dict(grad_worker_fraction=-1), ValueError),
        (dict(factor_update_steps=0), ValueError),
        (dict(inv_update_steps=-1), ValueError),
        (dict(damping=0.0), ValueError),
        (dict(factor_decay=0.0), ValueError),   # a constant 0 is refused, as in kfac_pytorch
        (dict(factor_decay=1.5), ValueError),
        (dict(kl_clip=0.0), ValueError),
        (dict(lr=-1.0), ValueError),
        (dict(accumulation_steps=0), ValueError),
    ]
    for kwargs, exc in cases:
        with pytest.raises(exc):
            KFACPreconditioner(tiny(), **kwargs)
    # allowed: the outer product is unused by INVERSE
    KFACPreconditioner(tiny(), compute_eigenvalue_outer_product=True, compute_method=ComputeMethod.INVERSE,
                       colocate_factors=False)


def test_mem_opt_without_colocation_warns_and_colocates():
    with pytest.warns(UserWarning, match="MEM_OPT.*Enabling colocate_factors"):
        pre = KFACPreconditioner(tiny(), compute_method=ComputeMethod.INVERSE, colocate_factors=False,
                                 grad_worker_fraction=DistributedStrategy.MEM_OPT)
    assert pre.colocate_factors is True and pre.distributed_strategy is DistributedStrategy.MEM_OPT
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # COMM_OPT without colocation: no warning
        pre = KFACPreconditioner(tiny(), compute_method="inverse", colocate_factors=False)
    assert pre.colocate_factors is False


def test_inv_update_steps_not_a_multiple_warns():
    with pytest.warns(UserWarning, match="integer multiple of factor_update_steps") as record:
        KFACPreconditioner(tiny(), factor_update_steps=3, inv_update_steps=4)
    assert record[0].filename == __file__  # attributed to the caller's line
    with pytest.warns(UserWarning, match="MEM_OPT") as record:
        KFACPreconditioner(tiny(), compute_method="inverse", colocate_factors=False, 
                           grad_worker_fraction=DistributedStrategy.MEM_OPT)
    assert record[0].filename == __file__


@pytest.mark.parametrize("world,value,fraction,strategy", [
    (4, 1, 1.0, DistributedStrategy.COMM_OPT),
    (4, DistributedStrategy.COMM_OPT, 1.0, DistributedStrategy.COMM_OPT),
    (4, DistributedStrategy.HYBRID_OPT, 0.5, DistributedStrategy.HYBRID_OPT),
    (4, DistributedStrategy.MEM_OPT, 0.25, DistributedStrategy.MEM_OPT),
    (4, 0, 0.25, DistributedStrategy.MEM_OPT),
    (4, 0.5, 0.5, DistributedStrategy.HYBRID_OPT),
    (1, 0, 1.0, DistributedStrategy.COMM_OPT),
    (1, DistributedStrategy.MEM_OPT, 1.0, DistributedStrategy.MEM_OPT),
])
def test_grad_worker_fraction_resolution(world, value, fraction, strategy):
    assert resolve_grad_worker_fraction(value, world) == (fraction, strategy)


def test_grad_worker_fraction_that_gives_unequal_groups():
    from torchsso2.distributed import WorkAssignment

    fraction, _ = resolve_grad_worker_fraction(0.33, 8)
    with pytest.raises(ValueError, match="grad_worker_fraction|integer"):
        WorkAssignment.from_sizes({"l": {"A": 3, "G": 4}}, 8, fraction)


# ---------------------------------------------------------------------------- enums from another library
def _foreign(name, members):
    return enum.Enum(name, members)


def test_enum_members_of_another_library_are_accepted_by_value():
    f_compute = _foreign("ComputeMethod", [("EIGEN", 1), ("INVERSE", 2)])
    f_assign = _foreign("AssignmentStrategy", [("COMPUTE", 1), ("MEMORY", 2)])
    f_dist = _foreign("DistributedStrategy", [("COMM_OPT", 1), ("MEM_OPT", 2), ("HYBRID_OPT", 3)])
    pre = KFACPreconditioner(tiny(), compute_method=f_compute.INVERSE, assignment_strategy=f_assign.MEMORY,
                             grad_worker_fraction=f_dist.HYBRID_OPT)
    assert pre.compute_method is ComputeMethod.INVERSE
    assert pre.assignment_strategy is AssignmentStrategy.MEMORY
    assert pre.distributed_strategy is DistributedStrategy.HYBRID_OPT and pre.grad_worker_fraction == 0.5
    wrong = _foreign("ComputeMethod", [("EIGEN", 1), ("CHOLESKY", 3)])
    with pytest.raises(TypeError, match="no counterpart"):
        KFACPreconditioner(tiny(), compute_method=wrong.CHOLESKY)
    other = _foreign("Colour", [("EIGEN", 1)])
    with pytest.raises(TypeError, match="compute_method must be a ComputeMethod"):
        KFACPreconditioner(tiny(), compute_method=other.EIGEN)


# ---------------------------------------------------------------------------- hyperparams
def test_exp_decay_factor_averaging_values():
    f = exp_decay_factor_averaging()
    assert callable(f) and isinstance(f(1), float)
    assert [f(s) for s in (0, 1, 5, 10, 100, 1000)] == [0.0, 0.0, 0.8, 0.9, 0.95, 0.95]
    values = [f(s) for s in range(1000)]
    assert all(a <= b for a, b in zip(values, values[1:]))
    assert [exp_decay_factor_averaging(1)(s) for s in (1, 10, 100)] == [0.0, 0.9, 0.99]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="min_value"):
            exp_decay_factor_averaging(bad)
    with pytest.raises(ValueError, match="negative"):
        f(-1)


def test_factor_decay_schedule_returning_zero_replaces_the_factors():
    """Steps 0 and 1 of exp_decay_factor_averaging return 0: A = the batch's A (no identity mix)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 2)).double()
    pre = KFACPreconditioner(model, factor_decay=exp_decay_factor_averaging(), damping=0.1)
    xs = [torch.randn(5, 3, dtype=torch.float64) for _ in range(2)]
    for x in xs:
        model(x).sum().backward()
        pre.step()
        ones = torch.ones(5, 1, dtype=torch.float64)
        a = torch.cat([x, ones], 1)
        layer = pre.layers["0"]
        torch.testing.assert_close(layer.a_factor, a.T @ a / 5, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="factor_decay.*returned by the callable"):
        bad = KFACPreconditioner(nn.Linear(3, 2), factor_decay=lambda s: -0.1)
        bad.factor_decay  # noqa: B018


# ---------------------------------------------------------------------------- scheduler
def _scaled(scale, constant=True):
    return lambda step: scale if constant else scale * step


def test_scheduler_multiplies_the_hyperparameters():
    pre = KFACPreconditioner(tiny(), factor_update_steps=1, inv_update_steps=1, damping=1, factor_decay=1,
                             kl_clip=1, lr=1)
    sched = LambdaParamScheduler(pre, factor_update_steps_lambda=_scaled(2), inv_update_steps_lambda=_scaled(3),
                                 damping_lambda=_scaled(5), factor_decay_lambda=_scaled(0.5),
                                 kl_clip_lambda=_scaled(9), lr_lambda=_scaled(11))
    for steps in range(1, 6):
        pre._steps = steps
        sched.step()
        assert (pre.factor_update_steps, pre.inv_update_steps) == (2 ** steps, 3 ** steps)
        assert (pre.damping, pre.factor_decay, pre.kl_clip, pre.lr) == (5 ** steps, 0.5 ** steps, 9 ** steps,
                                                                          11 ** steps)
    sched = LambdaParamScheduler(pre, damping_lambda=_scaled(5, constant=False))
    sched.step(step=2)  # the step passed overrides preconditioner.steps (5)
    assert pre.damping == 5 ** 5 * 10
    with pytest.raises(ValueError, match="damping must be a float > 0.*got 0 .*LambdaParamScheduler at step 0"):
        sched.step(step=0)  # a value out of range is refused (kfac_pytorch sets it)
    pre = KFACPreconditioner(tiny(), inv_update_steps=10)
    LambdaParamScheduler(pre, inv_update_steps_lambda=lambda s: 0.55).step()
    assert pre.inv_update_steps == 5 and isinstance(pre.inv_update_steps, int)
    LambdaParamScheduler(pre).step()  # nothing scheduled: a no-op


def test_scheduler_refuses_a_hyperparameter_that_is_already_callable():
    for name in ("factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip", "lr"):
        pre = KFACPreconditioner(tiny(), **{name: _scaled(1)})
        with pytest.raises(ValueError, match=f"{name} is already a callable"):
            LambdaParamScheduler(pre, **{f"{name}_lambda": _scaled(1)})
    with pytest.raises(AttributeError, match="has no _damping.*BaseKFACPreconditioner"):
        LambdaParamScheduler(torch.optim.SGD(tiny().parameters(), lr=0.1), damping_lambda=_scaled(1))
    with pytest.raises(TypeError, match="lr_lambda must be a callable"):
        LambdaParamScheduler(KFACPreconditioner(tiny()), lr_lambda=0.5)


def test_scheduled_values_are_used_by_the_step_and_saved():
    model, x = tiny(), torch.rand(4, 10)
    pre = KFACPreconditioner(model, damping=0.01, lr=0.1)
    sched = LambdaParamScheduler(pre, damping_lambda=lambda s: 0.5, lr_lambda=lambda s: 2.0)
    for _ in range(3):
        model(x).square().sum().backward()
        pre.step()
        sched.step()
    assert pre.damping == pytest.approx(0.01 * 0.5 ** 3) and pre.lr == pytest.approx(0.1 * 2 ** 3)
    state = pre.state_dict(include_factors=False)
    assert state["damping"] == pre.damping and state["lr"] == pre.lr and state["steps"] == 3


# ---------------------------------------------------------------------------- logging
def _kfac_records(caplog):
    return [r for r in caplog.records if r.name.startswith("torchsso2")]


def test_loglevel_is_respected(caplog):
    caplog.set_level(logging.INFO)
    KFACPreconditioner(tiny(), loglevel=logging.DEBUG)
    assert _kfac_records(caplog) == []  # the communicator choice included
    caplog.clear()
    KFACPreconditioner(tiny(), loglevel=logging.INFO)
    messages = [r.getMessage() for r in _kfac_records(caplog)]
    assert sum("Registered" in m for m in messages) == 2
    assert sum("KAISAAssignment" in m for m in messages) == 1
    assert sum("get_communicator('auto') chose" in m for m in messages) == 1
    assert all(r.levelno == logging.INFO for r in _kfac_records(caplog))


# ---------------------------------------------------------------------------- state dicts
def _train(pre, model, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.rand(4, 10, generator=gen)
        model(x).square().sum().backward()
        pre.step()
        for p in model.parameters():
            p.grad = None


def test_state_dict_format_and_round_trip():
    model = tiny()
    pre = KFACPreconditioner(model, damping=0.01, lr=lambda s: 0.1)
    _train(pre, model, 2)
    state = pre.state_dict(include_decompositions=False)  # exactly kfac_pytorch's keys
    assert set(state) == {"steps", "factor_update_steps", "inv_update_steps", "damping", "factor_decay", "kl_clip",
                          "layers"}  # lr is a callable: not saved
    assert set(pre.state_dict()) == set(state) | {"torchsso2"}  # default: decompositions for a bit-exact resume
    assert set(state["layers"]) == {"linear1", "linear2"} and state["steps"] == 2
    fresh_model = tiny(seed=5)
    fresh = KFACPreconditioner(fresh_model, damping=0.5)
    fresh.load_state_dict(state)
    assert fresh.steps == 2 and fresh.damping == 0.01
    for name in ("linear1", "linear2"):
        torch.testing.assert_close(fresh.layers[name].a_factor, pre.layers[name].a_factor)
    assert "layers" not in pre.state_dict(include_factors=False)
    with pytest.warns(UserWarning, match="inverses cannot be computed"):
        KFACPreconditioner(tiny()).load_state_dict(pre.state_dict(include_factors=False))


def test_a_checkpoint_without_factors_leaves_a_trained_preconditioners_factors_as_they_are():
    """docs/kfac.md: a preconditioner that already has factors keeps them and its decompositions on such a
    load (kfac_pytorch's load_state_dict touches the layers only when the dict has 'layers'); the counters
    are the checkpoint's."""
    import copy
    model = tiny()
    pre = KFACPreconditioner(model, damping=0.01, factor_update_steps=3, inv_update_steps=3)
    _train(pre, model, 1)
    light = pre.state_dict(include_factors=False)  # steps 1
    _train(pre, model, 3, seed=1)  # factors and decompositions of step 3
    factors = {n: (lay.a_factor.clone(), lay.g_factor.clone()) for n, lay in pre.layers.items()}
    twin_model, twin = copy.deepcopy((model, pre))
    with pytest.warns(UserWarning, match="inverses cannot be computed"):
        pre.load_state_dict(light)
    assert pre.steps == 1
    for n, lay in pre.layers.items():
        assert torch.equal(lay.a_factor, factors[n][0]) and torch.equal(lay.g_factor, factors[n][1])
    x = torch.rand(4, 10)
    for m, p in ((model, pre), (twin_model, twin)):  # steps 1 and 4: no factor or inverse update
        m(x).square().sum().backward()
        p.step()
    raw = torch.autograd.grad(twin_model(x).square().sum(), list(twin_model.parameters()))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin_model.parameters()))
    assert not all(torch.equal(r, b.grad) for r, b in zip(raw, twin_model.parameters()))  # preconditioned


def test_memory_usage_counts_factors_and_total():
    model = tiny()
    pre = KFACPreconditioner(model)
    assert pre.memory_usage()["total"] == 0
    _train(pre, model, 1)
    mem = pre.memory_usage()
    assert mem["a_factors"] == (10 * 10 + 21 * 21) * 4 and mem["g_factors"] == (20 * 20 + 10 * 10) * 4
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")


class _ToyLayer:
    def __init__(self, n):
        self.a = torch.ones(n)
        self.batch = 1

    def state_dict(self):
        return {"a": self.a.clone()}

    def load_state_dict(self, state):
        self.a = state["a"].clone()

    def memory_usage(self):
        return {"a": self.a.numel() * self.a.element_size()}

    def reset_batch(self):
        self.batch = None


def test_base_preconditioner_is_usable_on_its_own():
    layers = {nn.Linear(2, 2): ("x", _ToyLayer(3)), nn.Linear(2, 2): ("y", _ToyLayer(5))}
    base = BaseKFACPreconditioner(layers, assignment=None, tdc=None, damping=0.1, defaults={"note": 1})
    assert base.damping == 0.1 and base.steps == 0 and "note=1" in repr(base)
    assert base.memory_usage() == {"a": 32, "total": 32}
    state = base.state_dict()
    assert set(state["layers"]) == {"x", "y"}
    state["layers"]["x"]["a"] *= 2
    state["damping"] = 0.2
    base.load_state_dict(state, compute_inverses=False)
    assert base.damping == 0.2 and float(next(iter(layers.values()))[1].a[0]) == 2.0
    base.reset_batch()
    assert all(layer.batch is None for _, layer in layers.values())
    with pytest.raises(NotImplementedError, match="must implement step"):
        base.step()
    with pytest.raises(NotImplementedError, match="_recompute_inverses"):
        base.load_state_dict(state)
    with pytest.raises(ValueError, match="different number of layers"):
        base.load_state_dict({"steps": 0, "layers": {"x": {}}})
    with pytest.raises(ValueError, match="damping"):
        BaseKFACPreconditioner(layers, assignment=None, tdc=None, damping=-1.0)


# ---------------------------------------------------------------------------- training (as kfac_pytorch's)
def test_training_reduces_the_loss():
    torch.manual_seed(0)
    x, y = torch.rand(4, 10), torch.rand(4, 10)
    model = tiny()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pre = KFACPreconditioner(model, factor_update_steps=5, inv_update_steps=10, allreduce_bucket_cap_mb=0,
                             update_factors_in_hook=False)
    losses = []
    for _ in range(20):
        loss = nn.functional.mse_loss(model(x), y, reduction="sum")
        losses.append(loss.item())
        loss.backward()
        pre.step()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------- `import kfac`
ALIAS_SCRIPT = """
import sys
import torchsso2.kfac
torchsso2.kfac.install_as_kfac()
import kfac
from kfac.preconditioner import KFACPreconditioner
from kfac.enums import ComputeMethod
from kfac.scheduler import LambdaParamScheduler
import kfac.hyperparams
assert kfac is torchsso2.kfac
assert KFACPreconditioner is torchsso2.kfac.KFACPreconditioner
assert ComputeMethod is torchsso2.kfac.ComputeMethod
assert kfac.hyperparams.exp_decay_factor_averaging is torchsso2.kfac.exp_decay_factor_averaging
import kfac.layer  # one of ours: the same module object, not a second copy loaded from the same file
assert kfac.layer is torchsso2.kfac.layer is sys.modules["torchsso2.kfac.layer"]
try:
    import kfac.layers  # kfac_pytorch's internals are not provided
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("kfac.layers imported")
print("ok")
"""

FOREIGN_FIRST = """
import sys, types
sys.modules["kfac"] = types.ModuleType("kfac")          # a kfac imported before the alias
import torchsso2.kfac
try:
    torchsso2.kfac.install_as_kfac()
except RuntimeError as exc:
    assert "already imported" in str(exc)
else:
    raise SystemExit("no error")
torchsso2.kfac.install_as_kfac(force=True)
import kfac.scheduler
assert kfac.scheduler is torchsso2.kfac.scheduler
print("ok")
"""


@pytest.mark.parametrize("script", [ALIAS_SCRIPT, FOREIGN_FIRST], ids=["alias", "foreign-first"])
def test_install_as_kfac(script):
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# ---------------------------------------------------------------------------- on 2 and 4 gloo ranks
@pytest.mark.parametrize("world_size", [2, 4])
def test_distributed_scenarios(world_size, tmp_path):
    """kfac_pytorch's distributed constructor and training scenarios, on real ranks."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
    import kfac_compat_worker
    from dist_utils import run_gloo_ranks

    codes = run_gloo_ranks(kfac_compat_worker, world_size, tmp_path, deadline_s=150.0)
    assert codes == [0] * world_size, codes
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]
    s = results[0]["scenarios"]
    assert all(r["scenarios"] == s for r in results)
    assert s["zero"] == (1 / world_size, "MEM_OPT") and s["mem"] == (1 / world_size, "MEM_OPT")
    assert s["one"] == (1.0, "COMM_OPT") and s["hybrid"] == (0.5, "HYBRID_OPT")
    assert s["half"] == (0.5, "MEM_OPT" if world_size == 2 else "HYBRID_OPT")
    assert s["bad"][0] == "ValueError"  # 0.75 of 2 or 0.3 of 4 ranks: not a whole number of grad workers
    colocated, messages = s["mem_no_colocation"]
    assert colocated is True and any("Enabling colocate_factors" in m for m in messages)
    for r in results:
        for key in ("losses", "losses_mem"):
            assert r[key][-1] < r[key][0], (key, r[key])
            assert r[key] == results[0][key]  # DDP: the same loss on every rank
