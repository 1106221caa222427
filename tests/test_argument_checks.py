"""Arguments checked as the rest of the API checks them (a fuzz of the public arguments): NumPy numbers taken
where Python ones are, ints beyond a float named, misspelt choices answered with the closest name, any case
taken where KFACPreconditioner takes it, LR schedules on lr and momentum, a tensor lr named."""
from __future__ import annotations

import pytest
import torch

import curvature


def test_numpy_integers_and_numbers_are_taken_where_python_ones_are() -> None:
    """mc_samples, max_consecutive_skips and noise_variance refused NumPy scalars; a closure's NumPy float32
    loss was refused too."""
    import numpy as np
    from torchsso2 import SecondOrderOptimizer, VIOptimizer
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    x, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    curvature.compute(model, x, y, kind="fisher_mc", mc_samples=np.int64(2))
    opt = SecondOrderOptimizer(model, mc_samples=np.int64(1), max_consecutive_skips=np.int64(5))
    assert type(opt.max_consecutive_skips) is int
    VIOptimizer(torch.nn.Linear(3, 1), dataset_size=10, loss="mse", noise_variance=np.float32(0.5))

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return np.float32(loss.item())
    opt.step(closure)


@pytest.mark.parametrize("make", [
    lambda m: __import__("torchsso2").SecondOrderOptimizer(m, inv_update_interval=10 ** 400),
    lambda m: __import__("torchsso2").VIOptimizer(m, dataset_size=10, curv_update_interval=10 ** 400),
    lambda m: __import__("torchsso2").SecondOrderOptimizer(m, grad_worker_fraction=10 ** 400),
    lambda m: __import__("torchsso2").kfac.KFACPreconditioner(m, grad_worker_fraction=10 ** 400),
    lambda m: __import__("torchsso2").kfac.KFACPreconditioner(m, allreduce_bucket_cap_mb=10 ** 400),
    lambda m: __import__("torchsso2").VIOptimizer(m, dataset_size=10, loss="mse", noise_variance=10 ** 400),
], ids=["inv_update_interval", "vi-curv_update_interval", "grad_worker_fraction", "kfac-grad_worker_fraction",
        "allreduce_bucket_cap_mb", "noise_variance"])
def test_an_int_beyond_a_float_is_a_value_error_naming_the_argument(make) -> None:
    """It was Python's OverflowError from a float conversion, naming nothing."""
    with pytest.raises(ValueError, match=r"(update_interval|grad_worker_fraction|allreduce_bucket_cap_mb|"
                                         r"noise_variance)"):
        make(torch.nn.Linear(3, 2))


def test_vi_weight_decay_of_another_type_is_a_type_error() -> None:
    """A tensor of two values crashed in `weight_decay != 0.0` (torch's ambiguous truth value)."""
    from torchsso2 import VIOptimizer
    with pytest.raises(TypeError, match="weight_decay"):
        VIOptimizer(torch.nn.Linear(3, 2), dataset_size=10, weight_decay=torch.tensor([0.1, 0.2]))


@pytest.mark.parametrize("make,suggestion", [
    (lambda m: __import__("torchsso2").SecondOrderOptimizer(m, kfac_method="eigh"), "eigen"),
    (lambda m: __import__("torchsso2").SecondOrderOptimizer(m, on_nonfinite="skp"), "skip"),
    (lambda m: __import__("torchsso2").SecondOrderOptimizer(m, linalg="numpi"), "numpy"),
    (lambda m: __import__("torchsso2").SecondOrderOptimizer(m, communicator="mpl"), "mpi"),
    (lambda m: __import__("torchsso2").SecondOrderOptimizer(m, assignment_strategy="memry"), "memory"),
    (lambda m: __import__("torchsso2").VIOptimizer(m, dataset_size=10, loss="mse", noise_variance="learnd"), "learned"),
    (lambda m: __import__("torchsso2").kfac.KFACPreconditioner(m, compute_method="eigne"), "eigen"),
], ids=["kfac_method", "on_nonfinite", "linalg", "communicator", "assignment_strategy", "noise_variance",
        "compute_method"])
def test_a_misspelt_choice_names_the_closest_one(make, suggestion) -> None:
    """Some choice arguments suggested the closest name (approx, curvature, loss), these did not."""
    with pytest.raises(ValueError, match=rf"did you mean '{suggestion}'"):
        make(torch.nn.Linear(3, 2))


def test_choices_of_another_case_are_taken_as_kfac_preconditioner_takes_them() -> None:
    from torchsso2 import SecondOrderOptimizer, VIOptimizer
    assert SecondOrderOptimizer(torch.nn.Linear(3, 2), kfac_method=" Inverse", on_nonfinite="RAISE").kfac_method == "inverse"
    vi = VIOptimizer(torch.nn.Linear(3, 1), dataset_size=10, loss="mse", noise_variance=" Learned")
    assert vi.noise.learned and vi.noise_variance == "learned"  # one spelling, compared across ranks


def test_lr_schedules_drive_lr_and_momentum_and_a_tensor_lr_is_named() -> None:
    """README: OneCycleLR cycles the groups' lr and momentum; lr is a number (a tensor lr is a TypeError)."""
    import torch.nn.functional as F
    from torchsso2 import SecondOrderOptimizer, VIOptimizer
    for make in (lambda m: SecondOrderOptimizer(m, lr=0.1), lambda m: VIOptimizer(m, dataset_size=100)):
        model = torch.nn.Linear(3, 2)
        opt = make(model)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)
        x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        seen = []
        for _ in range(3):
            def closure():
                opt.zero_grad()
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                return loss
            opt.step(closure)
            schedule.step()
            seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]))
        assert seen[0][0] < seen[-1][0] and seen[0][1] > seen[-1][1]  # warm-up: lr up, momentum down
    with pytest.raises(TypeError, match=r"lr must be a real number, got Tensor.*pass a Python float"):
        SecondOrderOptimizer(torch.nn.Linear(3, 2), lr=torch.tensor(0.1))
    with pytest.raises(TypeError, match=r"lr must be a real number, got Tensor.*pass a Python float"):
        VIOptimizer(torch.nn.Linear(3, 2), dataset_size=100, lr=torch.tensor(0.1))


def test_numpy_interval_takes_its_default_kl_clip_and_kfac_on_nonfinite_takes_any_case() -> None:
    import numpy as np
    from torchsso2 import SecondOrderOptimizer
    from torchsso2.kfac import KFACPreconditioner
    ref = SecondOrderOptimizer(torch.nn.Linear(3, 3), inv_update_interval=10).kl_clip
    assert SecondOrderOptimizer(torch.nn.Linear(3, 3), inv_update_interval=np.int64(10)).kl_clip == ref  # (was 1e-3)
    assert SecondOrderOptimizer(torch.nn.Linear(3, 2), linalg=" NumPy ").linalg == "numpy"
    assert KFACPreconditioner(torch.nn.Linear(3, 2), on_nonfinite="RAISE").on_nonfinite == "raise"
    with pytest.raises(ValueError, match="did you mean 'skip'"):
        KFACPreconditioner(torch.nn.Linear(3, 2), on_nonfinite="skp")



@pytest.mark.parametrize("face,attr,value,error,match", [
    ("sso", "kl_clip", float("nan"), ValueError, None),  # min(1, nan) = 1: the clip was silently off
    ("sso", "kl_clip", -1.0, ValueError, None),  # a math domain error after the curvature was folded in
    ("sso", "kl_clip", float("inf"), ValueError, None),  # the constructor refuses it; the clip was silently off
    ("sso", "ema_decay", 2.0, ValueError, None),
    ("sso-adaptive", "kl_clip", 1e-3, ValueError, "kl_clip=0.001 cannot be combined"),  # an adaptive lr ignored it
    ("vi", "kl_clip", float("nan"), ValueError, None),
    ("vi", "kl_clip", float("inf"), ValueError, None),
    ("vi", "damping", "0.1", TypeError, None),  # a raw TypeError at the step, and state_dict() broke
    ("vi", "damping", float("nan"), ValueError, None),  # every step skipped as "non-finite curvature"
    ("vi", "ema_decay", -1.0, ValueError, None),
    ("vi", "kl_weighting", 0.0, ValueError, None),
    ("vi", "prior_precision", 1e39, ValueError, None),
    ("vi", "prior_precision", 0.0, ValueError, "must be > 0"),  # with damping 0: a singular precision
])
def test_attributes_set_between_steps_are_checked_at_the_next_step(face, attr, value, error, match) -> None:
    from optim_helpers import make_closure
    from torchsso2 import SecondOrderOptimizer, VIOptimizer
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    opt = (SecondOrderOptimizer(model, kl_clip=1e-3) if face == "sso"
           else SecondOrderOptimizer(model, use_adaptive_learning_rate=True) if face == "sso-adaptive"
           else VIOptimizer(model, dataset_size=100, kl_clip=1e-3, curvature="fisher_mc"))
    closure = make_closure(opt, model, torch.randn(8, 3), torch.randint(0, 2, (8,)))
    opt.step(closure)
    params = [p.detach().clone() for p in model.parameters()]
    steps = opt.num_steps
    good = getattr(opt, attr)
    setattr(opt, attr, value)
    with pytest.raises(error, match=match or f"{type(opt).__name__}.{attr}"):
        opt.step(closure)
    with pytest.raises(error, match=match or f"{type(opt).__name__}.{attr}"):  # a raw TypeError there before
        opt.state_dict()
    assert opt.num_steps == steps and all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
    setattr(opt, attr, good)
    opt.step(closure)
    assert opt.num_steps == steps + 1


def test_vi_posterior_scales_beyond_float32_are_refused_at_construction() -> None:
    """Each argument within float32, their products not: every step had been skipped, blaming the data."""
    from torchsso2 import VIOptimizer
    with pytest.raises(ValueError, match=r"prior_precision·kl_weighting \+ damping = 1e\+40 is beyond"):
        VIOptimizer(torch.nn.Linear(3, 2), dataset_size=10, prior_precision=1e20, kl_weighting=1e20)
    with pytest.raises(ValueError, match=r"dataset_size / noise_variance = 1e\+40 is beyond"):
        VIOptimizer(torch.nn.Linear(3, 2), dataset_size=10 ** 4, loss="mse", noise_variance=1e-36)
    VIOptimizer(torch.nn.Linear(3, 2), dataset_size=10 ** 4, loss="mse", noise_variance=1e-30)  # 1e34: held
