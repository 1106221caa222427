"""The same calls on kfac_pytorch 0.4.2 and on ``torchsso2.kfac`` give the same outcome.

Skipped when kfac_pytorch (``import kfac``) is not installed. Compared: public names,
signatures and defaults, the outcome of constructor calls (exception class, warnings,
resolved attributes), enum members passed across libraries, the parameter scheduler,
``exp_decay_factor_averaging``, log records, ``state_dict`` (also loaded across libraries)
and ``memory_usage`` keys. Deliberate differences are listed in docs/kfac.md.
"""
from __future__ import annotations

import enum
import inspect
import logging
import warnings

import pytest
import torch

kfacpt = pytest.importorskip("kfac")
pytest.importorskip("kfac.preconditioner")
import kfac.base_preconditioner as pt_base  # noqa: E402
import kfac.enums as pt_enums  # noqa: E402
import kfac.hyperparams as pt_hyper  # noqa: E402
import kfac.preconditioner as pt_pre  # noqa: E402
import kfac.scheduler as pt_sched  # noqa: E402

import torchsso2.kfac as ours  # noqa: E402
from dist_scripts.kfac_tiny import Tiny  # noqa: E402

if getattr(kfacpt, "__file__", "") and "torchsso2" in kfacpt.__file__:  # the alias, not kfac_pytorch
    pytest.skip("'kfac' is torchsso2's alias here", allow_module_level=True)


def tiny(seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


MODULES = ["enums", "preconditioner", "base_preconditioner", "scheduler", "hyperparams", "warnings"]


def _public(module):
    return [n for n, obj in vars(module).items()
            if not n.startswith("_") and getattr(obj, "__module__", None) == module.__name__]


def test_every_public_name_exists():
    import importlib

    for name in MODULES:
        theirs = importlib.import_module(f"kfac.{name}")
        mine = getattr(ours, name)
        missing = [n for n in _public(theirs) if not hasattr(mine, n)]
        assert not missing, f"kfac.{name}: {missing}"
    for enum_name in ("AllreduceMethod", "AssignmentStrategy", "ComputeMethod", "DistributedStrategy"):
        theirs, mine = getattr(pt_enums, enum_name), getattr(ours.enums, enum_name)
        assert [(m.name, m.value) for m in theirs] == [(m.name, m.value) for m in mine]


def _same_default(a, b):
    if isinstance(a, enum.Enum) or isinstance(b, enum.Enum):
        return (type(a).__name__, a.name, a.value) == (type(b).__name__, b.name, b.value)
    return a == b


@pytest.mark.parametrize("theirs,mine", [
    (pt_pre.KFACPreconditioner.__init__, ours.KFACPreconditioner.__init__),
    (pt_base.BaseKFACPreconditioner.__init__, ours.BaseKFACPreconditioner.__init__),
    (pt_base.BaseKFACPreconditioner.state_dict, ours.BaseKFACPreconditioner.state_dict),
    (pt_base.BaseKFACPreconditioner.load_state_dict, ours.BaseKFACPreconditioner.load_state_dict),
    (pt_sched.LambdaParamScheduler.__init__, ours.LambdaParamScheduler.__init__),
    (pt_sched.LambdaParamScheduler.step, ours.LambdaParamScheduler.step),
    (pt_hyper.exp_decay_factor_averaging, ours.exp_decay_factor_averaging),
], ids=["KFACPreconditioner", "Base", "state_dict", "load_state_dict", "scheduler", "scheduler.step",
        "exp_decay"])
def test_signatures_and_defaults(theirs, mine):
    tp, mp = inspect.signature(theirs).parameters, inspect.signature(mine).parameters
    for name, p in tp.items():
        assert name in mp, name
        assert mp[name].kind == p.kind, name
        assert _same_default(p.default, mp[name].default), (name, p.default, mp[name].default)


def test_public_attributes_and_properties():
    theirs, mine = pt_pre.KFACPreconditioner(tiny()), ours.KFACPreconditioner(tiny())
    public = [n for n in dir(theirs) if not n.startswith("__")]
    missing = [n for n in public if not hasattr(mine, n)]
    # kfac_pytorch's private hook methods are internals of its layer machinery
    assert set(missing) <= {"_save_input", "_save_grad_output", "_compute_grad_scale"}, missing


def _outcome(cls, enums, kwargs):
    """(exception class or None, warning messages' first words, resolved attributes)."""
    kwargs = {k: (v(enums) if callable(v) and getattr(v, "_enum_arg", False) else v) for k, v in kwargs.items()}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            pre = cls(tiny(), **kwargs)
        except Exception as exc:  # noqa: BLE001 - the class is what we compare
            return exc, [], {}
    attrs = {}
    for name in ("grad_worker_fraction", "colocate_factors", "allreduce_bucket_cap_mb", "symmetry_aware",
                 "compute_eigenvalue_outer_product", "damping", "factor_decay", "kl_clip", "lr",
                 "factor_update_steps", "inv_update_steps", "steps"):
        attrs[name] = getattr(pre, name)
    for name in ("distributed_strategy", "allreduce_method", "compute_method", "assignment_strategy"):
        attrs[name] = getattr(pre, name).name
    return None, sorted(str(w.category.__name__) for w in caught), attrs


def enum_arg(fn):
    fn._enum_arg = True
    return fn


CASES = {
    "defaults": {},
    "compute_method='inverse'": dict(compute_method="inverse"),
    "compute_method='INVERSE'": dict(compute_method="INVERSE"),
    "assignment_strategy='memory'": dict(assignment_strategy="memory"),
    "compute_method='svd'": dict(compute_method="svd"),
    "assignment_strategy='fastest'": dict(assignment_strategy="fastest"),
    "allreduce_bucket_cap_mb=0": dict(allreduce_bucket_cap_mb=0),
    "allreduce_bucket_cap_mb=-1": dict(allreduce_bucket_cap_mb=-1),
    "colocate_factors=1": dict(colocate_factors=1),
    "symmetry_aware=1": dict(symmetry_aware=1),
    "kl_clip=None": dict(kl_clip=None),
    "kl_clip=0": dict(kl_clip=0.0),
    "damping=0": dict(damping=0.0),
    "factor_decay=0": dict(factor_decay=0.0),
    "factor_decay=1": dict(factor_decay=1.0),
    "lr=0": dict(lr=0.0),
    "lr=-1": dict(lr=-1.0),
    "factor_update_steps=0": dict(factor_update_steps=0),
    "inv not multiple": dict(factor_update_steps=3, inv_update_steps=4),
    "accumulation_steps=0": dict(accumulation_steps=0),
    "grad_worker_fraction=2": dict(grad_worker_fraction=2),
    "grad_worker_fraction=-1": dict(grad_worker_fraction=-1),
    "grad_worker_fraction=0": dict(grad_worker_fraction=0),
    "grad_worker_fraction=0.5": dict(grad_worker_fraction=0.5),
    "grad_worker_fraction=1": dict(grad_worker_fraction=1),
    "eigen outer product, no colocation": dict(colocate_factors=False,
                                               compute_method=enum_arg(lambda e: e.ComputeMethod.EIGEN)),
    "inverse, no colocation": dict(colocate_factors=False,
                                   compute_method=enum_arg(lambda e: e.ComputeMethod.INVERSE)),
    "MEM_OPT, no colocation": dict(colocate_factors=False, compute_method=enum_arg(lambda e: e.ComputeMethod.INVERSE),
                                   grad_worker_fraction=enum_arg(lambda e: e.DistributedStrategy.MEM_OPT)),
    "HYBRID_OPT": dict(grad_worker_fraction=enum_arg(lambda e: e.DistributedStrategy.HYBRID_OPT)),
    "memory enum": dict(assignment_strategy=enum_arg(lambda e: e.AssignmentStrategy.MEMORY)),
    "callables": dict(damping=lambda s: 0.01, lr=lambda s: 0.2, factor_decay=lambda s: 0.9),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_outcome_of_constructor_calls(case):
    kwargs = CASES[case]
    t_exc, t_warn, t_attrs = _outcome(pt_pre.KFACPreconditioner, pt_enums, kwargs)
    m_exc, m_warn, m_attrs = _outcome(ours.KFACPreconditioner, ours.enums, kwargs)
    if t_exc is not None:
        assert isinstance(m_exc, type(t_exc)), f"{case}: kfac_pytorch raised {t_exc!r}, we {m_exc!r}"
        return
    assert m_exc is None, f"{case}: kfac_pytorch accepted it, we raised {m_exc!r}"
    assert m_warn == t_warn, case
    for name, value in t_attrs.items():
        if callable(value):
            continue
        assert m_attrs[name] == value, (case, name, m_attrs[name], value)


@pytest.mark.parametrize("case", ["MEM_OPT, no colocation", "HYBRID_OPT", "memory enum", "inverse, no colocation"])
def test_kfac_pytorch_enum_members_are_accepted(case):
    """kfac_pytorch's own enum members, passed to torchsso2, act as ours."""
    t_exc, t_warn, t_attrs = _outcome(pt_pre.KFACPreconditioner, pt_enums, CASES[case])
    m_exc, m_warn, m_attrs = _outcome(ours.KFACPreconditioner, pt_enums, CASES[case])
    assert t_exc is None and m_exc is None, m_exc
    assert (m_warn, m_attrs) == (t_warn, t_attrs)


def test_scheduler_same_sequence():
    def run(mod_pre, mod_sched):
        pre = mod_pre.KFACPreconditioner(tiny(), damping=0.01, factor_decay=0.5, kl_clip=0.01, lr=0.1,
                                         factor_update_steps=2, inv_update_steps=4)
        sched = mod_sched.LambdaParamScheduler(
            pre, damping_lambda=lambda s: 0.9 if s % 2 else 1.1, factor_decay_lambda=lambda s: 1.01,
            kl_clip_lambda=lambda s: 0.5 * s, lr_lambda=lambda s: 1.5, factor_update_steps_lambda=lambda s: 1.5,
            inv_update_steps_lambda=lambda s: 1.2)
        out = []
        for step in range(6):
            pre._steps = step
            sched.step() if step % 3 else sched.step(step=step + 10)
            out.append((pre.damping, pre.factor_decay, pre.kl_clip, pre.lr, pre.factor_update_steps,
                        pre.inv_update_steps))
        return out

    assert run(ours.preconditioner, ours.scheduler) == run(pt_pre, pt_sched)
    for lam in ("damping", "lr"):
        for mod_pre, mod_sched in ((pt_pre, pt_sched), (ours.preconditioner, ours.scheduler)):
            pre = mod_pre.KFACPreconditioner(tiny(), **{lam: lambda s: 0.1})
            with pytest.raises(ValueError):
                mod_sched.LambdaParamScheduler(pre, **{f"{lam}_lambda": lambda s: 1.0})


def test_exp_decay_factor_averaging_same_values():
    for min_value in (0.95, 0.1, 1, 0.5):
        theirs, mine = pt_hyper.exp_decay_factor_averaging(min_value), ours.exp_decay_factor_averaging(min_value)
        assert [mine(s) for s in range(300)] == [theirs(s) for s in range(300)]
    for bad in (0, -1):
        with pytest.raises(ValueError):
            pt_hyper.exp_decay_factor_averaging(bad)
        with pytest.raises(ValueError):
            ours.exp_decay_factor_averaging(bad)


def test_kfac_pytorch_factor_averaging_helper_trains_with_torchsso2():
    """kfac_pytorch's own helper returns 0.0 at steps 0 and 1; torchsso2 accepts it as kfac_pytorch does."""
    model, x = tiny(), torch.rand(4, 10)
    pre = ours.KFACPreconditioner(model, factor_decay=pt_hyper.exp_decay_factor_averaging())
    for _ in range(3):
        model(x).square().sum().backward()
        pre.step()
    assert pre.steps == 3


def _records(caplog, prefix):
    return [r.getMessage() for r in caplog.records if r.name.startswith(prefix)]


def test_same_log_records(caplog):
    caplog.set_level(logging.INFO)
    for level, expected in ((logging.DEBUG, 0), (logging.INFO, None)):
        caplog.clear()
        pt_pre.KFACPreconditioner(tiny(), loglevel=level)
        theirs = _records(caplog, "kfac")
        caplog.clear()
        ours.KFACPreconditioner(tiny(), loglevel=level)
        mine = _records(caplog, "torchsso2")
        if expected == 0:
            assert theirs == [] and mine == []
        else:
            for word in ("Registered", "KAISAAssignment"):
                assert sum(word in m for m in mine) == sum(word in m for m in theirs) > 0, word


def _train(pre, model, steps=3):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        model(torch.rand(4, 10, generator=gen)).square().sum().backward()
        pre.step()
        for p in model.parameters():
            p.grad = None


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # kfac_pytorch's hooks on a first layer
def test_state_dicts_same_format_and_loadable_across_libraries():
    kw = dict(damping=0.01, factor_decay=0.9, lr=lambda s: 0.1)
    t_model, m_model = tiny(), tiny()
    theirs, mine = pt_pre.KFACPreconditioner(t_model, **kw), ours.KFACPreconditioner(m_model, **kw)
    _train(theirs, t_model)
    _train(mine, m_model)
    ts, ms = theirs.state_dict(), mine.state_dict(include_decompositions=False)
    assert set(ts) == set(ms) and set(ts["layers"]) == set(ms["layers"])
    assert {k: v for k, v in ts.items() if k != "layers"} == {k: v for k, v in ms.items() if k != "layers"}
    for name in ts["layers"]:
        assert set(ts["layers"][name]) == set(ms["layers"][name]) == {"A", "G"}
        for key in ("A", "G"):
            torch.testing.assert_close(ms["layers"][name][key], ts["layers"][name][key], rtol=1e-5, atol=1e-7)
    # a kfac_pytorch checkpoint resumes in torchsso2 and the other way round
    resumed = ours.KFACPreconditioner(tiny(1))
    resumed.load_state_dict(ts)
    assert resumed.steps == 3 and resumed.damping == 0.01
    back = pt_pre.KFACPreconditioner(tiny(1))
    back.load_state_dict(ms)
    assert back.steps == 3
    back_default = pt_pre.KFACPreconditioner(tiny(1))
    back_default.load_state_dict(mine.state_dict())  # our default adds the "torchsso2" key; kfac_pytorch ignores it
    assert back_default.steps == 3
    t_mem, m_mem = theirs.memory_usage(), mine.memory_usage()
    assert set(m_mem) == set(t_mem)
    for key in ("a_factors", "g_factors", "total"):
        assert m_mem[key] > 0 and t_mem[key] > 0
    assert m_mem["a_factors"] == t_mem["a_factors"] and m_mem["g_factors"] == t_mem["g_factors"]


@pytest.mark.parametrize("kwargs,exc", [
    (dict(symmetry_aware="no"), TypeError),
    (dict(compute_method="eigen", colocate_factors=False), ValueError),
    (dict(factor_update_steps=1.5, inv_update_steps=3), TypeError),
    (dict(accumulation_steps=1.5), TypeError),
    (dict(lr=float("inf")), ValueError),
    (dict(factor_dtype=torch.int32), TypeError),
    (dict(inv_dtype=None), TypeError),
    (dict(grad_scaler=3.0), TypeError),
    (dict(skip_layers="fc"), TypeError),
], ids=["string flag", "eigen string without colocation", "fractional update steps", "fractional accumulation",
        "infinite lr", "int factor dtype", "no inv dtype", "number as grad scaler", "string skip_layers"])
def test_documented_stricter_checks(kwargs, exc):
    """docs/kfac.md lists these: kfac_pytorch accepts them, torchsso2 refuses them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pt_pre.KFACPreconditioner(tiny(), **kwargs)
    with pytest.raises(exc):
        ours.KFACPreconditioner(tiny(), **kwargs)


def test_enum_argument_of_another_type():
    """kfac_pytorch fails an internal assertion; torchsso2 raises a TypeError naming the argument."""
    for kwargs in (dict(compute_method=3), dict(assignment_strategy=3)):
        with pytest.raises(AssertionError):
            pt_pre.KFACPreconditioner(tiny(), **kwargs)
        with pytest.raises(TypeError, match=next(iter(kwargs))):
            ours.KFACPreconditioner(tiny(), **kwargs)
