"""The shared settings object of the native optimizers (torchsso2/optim/settings.py)."""
from dataclasses import fields

import pytest
import torch
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.optim.settings import CurvatureSettings


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def test_faces_hand_their_shared_arguments_to_one_settings_object() -> None:
    sso = SecondOrderOptimizer(_model(), curvature="empirical_fisher", ema_decay=0.5, curv_update_interval=3,
                               inv_update_interval=6, on_nonfinite="raise", max_consecutive_skips=7)
    s = sso.settings
    assert (s.curvature, s.ema_decay, s.curv_update_interval, s.inv_update_interval, s.on_nonfinite,
            s.max_consecutive_skips) == ("empirical_fisher", 0.5, 3, 6, "raise", 7)
    assert (sso.ema_decay, sso.curv_update_interval, sso.inv_update_interval) == (0.5, 3, 6)
    vi = VIOptimizer(_model(), dataset_size=10, curvature="reparam", approx="diag", ema_decay=0.9)
    assert vi.settings.curvature == "fisher" and vi.settings.ema_decay == 0.9  # reparam: the engine's kind


def test_from_arguments_takes_every_field_by_name_and_overrides_first() -> None:
    names = [f.name for f in fields(CurvatureSettings)]
    args = dict(curvature="fisher_mc", approx="diag", loss="mse", mc_samples=2, skip_modules=None, ema_decay=0.1,
                curv_update_interval=2, inv_update_interval=4, on_nonfinite="skip", linalg=None,
                communicator="none", seed=3, decomposition_dtype=torch.float64, grad_scaler=None,
                grad_worker_fraction="comm_opt", assignment_strategy="compute", output_selector=None,
                max_consecutive_skips=None, kfac_approx="reduce", any_module=True, unrelated="ignored")
    s = CurvatureSettings.from_arguments(args, approx="kfac")
    expected = {**args, "approx": "kfac", "linalg": "torch"}  # linalg=None: resolved once, here "torch"
    assert [getattr(s, n) for n in names] == [expected[n] for n in names]
    with pytest.raises(KeyError):
        CurvatureSettings.from_arguments({"curvature": "fisher"})


@pytest.mark.parametrize("field,value,error,match", [
    ("ema_decay", 1.0, ValueError, "ema_decay=1.0"),
    ("curv_update_interval", 0, ValueError, "curv_update_interval=0"),
    ("on_nonfinite", "ignore", ValueError, "on_nonfinite='ignore'"),
    ("curvature", "fisher-mc", ValueError, "fisher_mc"),
    ("decomposition_dtype", torch.float16, ValueError, "decomposition_dtype"),
    ("grad_scaler", object(), TypeError, "GradScaler"),
    ("linalg", "magma", ValueError, "magma"),
    ("kfac_approx", "shrink", ValueError, "kfac_approx='shrink'"),
])
def test_settings_are_validated_when_built(field: str, value: object, error: type, match: str) -> None:
    good = dict(curvature="fisher", approx="diag", loss="cross_entropy", mc_samples=1, skip_modules=None,
                ema_decay=0.9, curv_update_interval=1, inv_update_interval=1, on_nonfinite="skip", linalg=None,
                communicator="none", seed=None, decomposition_dtype=None, grad_scaler=None,
                grad_worker_fraction="comm_opt", assignment_strategy="compute", output_selector=None,
                max_consecutive_skips=20)
    CurvatureSettings(**good)
    with pytest.raises(error, match=match):
        CurvatureSettings(**{**good, field: value})
