"""Values as configuration files deliver them (Hydra/OmegaConf containers, YAML numbers read as strings, JSON
keys, dtypes by name): taken where they mean what the Python literal means, refused with a named error
where they do not — never read as something else (a mapping of skip_modules was read as its keys)."""
from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch import nn

from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner


def _twelve() -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(12)])


def test_a_mapping_of_skip_modules_is_refused_not_read_as_its_keys() -> None:
    """Hydra users toggle maps of booleans ({head: false}); iterated, a mapping gave its keys and skipped head."""
    with pytest.raises(TypeError, match=r"got a mapping \{'11': False\}.*\[k for k, v in skip_modules.items\(\) if v\]"):
        SecondOrderOptimizer(_twelve(), skip_modules={"11": False})
    with pytest.raises(TypeError, match="skip_layers must be a list of regex strings"):
        KFACPreconditioner(_twelve(), skip_layers={"11": True})


def test_a_sequence_type_of_a_config_library_is_taken_for_skip_layers() -> None:
    """OmegaConf's ListConfig is a Sequence, not a list (kfac_pytorch takes it): UserList stands in."""
    pre = KFACPreconditioner(_twelve(), skip_layers=collections.UserList(["^11$"]))
    assert "11" not in pre.layers and "10" in pre.layers and pre.skip_layers == ["^11$"]


def test_an_integer_approx_key_is_named() -> None:
    with pytest.raises(TypeError, match=r"approx keys must be .* got int 0; quote it \('0', or '\^0\$'"):
        SecondOrderOptimizer(_twelve(), approx={0: "full"})


def test_a_module_name_that_also_picks_other_modules_is_named() -> None:
    """'1' is module 1's name, and as a regex it also picks '10' and '11'."""
    with pytest.warns(UserWarning, match=r"approx entry '1' is the name of module '1', but .* also picks \['10', '11'\]"
                                         r": anchor it \('\^1\$'\)"):
        opt = SecondOrderOptimizer(_twelve(), approx={"1": "full"})
    assert opt.engine.approx["10"].value == "full"  # the documented regex semantics stand
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SecondOrderOptimizer(_twelve(), approx={"^1$": "full"}, skip_modules=["^11$"])
        SecondOrderOptimizer(nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.Linear(4, 4)), approx={"0": "full"})


def test_choices_in_any_case_except_pytorch_ssos_fisher() -> None:
    opt = SecondOrderOptimizer(_twelve(), approx="DIAG", curvature="Fisher_MC", loss="MSE", kfac_approx="Expand")
    assert opt.engine.kind.value == "fisher_mc" and opt.engine.loss.value == "mse"
    assert set(a.value for a in opt.engine.approx.values()) == {"diag"}
    assert VIOptimizer(_twelve(), dataset_size=8, curvature="REPARAM").reparam
    with pytest.raises(ValueError, match="another library's name"):  # PyTorch-SSO's 'Fisher' is the MC Fisher
        SecondOrderOptimizer(_twelve(), curvature="Fisher")


def test_dtypes_by_name() -> None:
    assert SecondOrderOptimizer(_twelve(), decomposition_dtype="float64").decomposition_dtype is torch.float64
    pre = KFACPreconditioner(_twelve(), factor_dtype="torch.float64", inv_dtype="float64")
    assert pre.factor_dtype is torch.float64 and pre.inv_dtype is torch.float64
    with pytest.raises(TypeError, match="factor_dtype must be a floating torch.dtype"):
        KFACPreconditioner(_twelve(), factor_dtype="int64")


@pytest.mark.parametrize("key, value", [("momentum", "0.9"), ("grad_ema_decay", "0.1"), ("kl_weighting", "1")])
def test_the_compat_layer_names_a_number_given_as_a_string(key: str, value: str) -> None:
    """PyYAML reads 1e-3 as a string: some compat arguments raised a bare '<' between str and int, others
    were converted silently."""
    from torchsso2.compat import pytorch_sso
    with pytest.raises(TypeError, match=f"{key} must be a real number, got str '{value}'"):
        pytorch_sso.VIOptimizer(nn.Linear(3, 2), 64, "Cov", {"Linear": "Diag"}, {"damping": 1e-3}, **{key: value})
