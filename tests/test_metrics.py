"""Tests for torchsso2.metrics and torchsso2.plotting against hand-computed values."""
import math
import sys

import numpy as np
import pytest
import torch

from torchsso2 import metrics
from torchsso2.metrics import ReliabilityData

nan = float("nan")

# --------------------------------------------------------------------------- #
# Fixture: 4 examples, 3 classes, 5 bins (0,.2] (.2,.4] (.4,.6] (.6,.8] (.8,1]
#
#   n  probs               target  argmax  correct  conf  bin
#   0  [0.70, 0.20, 0.10]  0       0       yes      0.70  3
#   1  [0.30, 0.50, 0.20]  2       1       no       0.50  2
#   2  [0.25, 0.30, 0.45]  2       2       yes      0.45  2
#   3  [0.05, 0.90, 0.05]  0       1       no       0.90  4
# --------------------------------------------------------------------------- #
PROBS = torch.tensor(
    [[0.70, 0.20, 0.10],
     [0.30, 0.50, 0.20],
     [0.25, 0.30, 0.45],
     [0.05, 0.90, 0.05]],
    dtype=torch.float64,
)
TARGETS = torch.tensor([0, 2, 2, 0])

# accuracy = 2 correct / 4 = 0.5
ACC = 0.5
# nll = -(ln .70 + ln .20 + ln .45 + ln .05) / 4
#     = (0.356675 + 1.609438 + 0.798508 + 2.995732) / 4 = 5.760353 / 4
NLL = 1.44008829
# brier rows:
#   0: (.7-1)^2 + .2^2 + .1^2       = .09 + .04 + .01       = 0.14
#   1: .3^2 + .5^2 + (.2-1)^2       = .09 + .25 + .64       = 0.98
#   2: .25^2 + .3^2 + (.45-1)^2     = .0625 + .09 + .3025   = 0.455
#   3: (.05-1)^2 + .9^2 + .05^2     = .9025 + .81 + .0025   = 1.715
#   mean = 3.29 / 4
BRIER = 0.8225
# ECE, 5 bins:
#   bin 2 {1, 2}: acc = 1/2 = .5, conf = (.5 + .45)/2 = .475, |gap| = .025, weight 2/4 -> .0125
#   bin 3 {0}:    acc = 1,        conf = .7,                  |gap| = .3,   weight 1/4 -> .075
#   bin 4 {3}:    acc = 0,        conf = .9,                  |gap| = .9,   weight 1/4 -> .225
#   ECE = .0125 + .075 + .225
ECE5 = 0.3125
# entropy row 0: -(.7 ln .7 + .2 ln .2 + .1 ln .1) = .249672 + .321888 + .230259
H0 = 0.80181855


def _assert_nan_equal(actual, expected, atol=1e-12):
    actual = torch.as_tensor(actual, dtype=torch.float64)
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.shape == expected.shape
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), (actual, expected)
    mask = ~torch.isnan(expected)
    assert torch.allclose(actual[mask], expected[mask], atol=atol, rtol=0), (actual, expected)


# --------------------------------------------------------------------------- #
# Hand-computed values
# --------------------------------------------------------------------------- #
def test_scalar_metrics_match_hand_computation():
    assert metrics.accuracy(PROBS, TARGETS) == pytest.approx(ACC, abs=1e-12)
    assert metrics.nll(PROBS, TARGETS) == pytest.approx(NLL, abs=1e-7)
    # the constant above is consistent with the symbolic expression
    assert NLL == pytest.approx(-(math.log(.7) + math.log(.2) + math.log(.45) + math.log(.05)) / 4, abs=1e-7)
    assert metrics.brier(PROBS, TARGETS) == pytest.approx(BRIER, abs=1e-12)
    assert metrics.ece(PROBS, TARGETS, n_bins=5) == pytest.approx(ECE5, abs=1e-12)


def test_return_types_are_python_floats():
    out = metrics.evaluate(PROBS, TARGETS, n_bins=5)
    assert set(out) == {"accuracy", "nll", "ece", "brier"}
    assert all(type(v) is float for v in out.values())
    assert out["accuracy"] == pytest.approx(ACC, abs=1e-12)
    assert out["nll"] == pytest.approx(NLL, abs=1e-7)
    assert out["ece"] == pytest.approx(ECE5, abs=1e-12)
    assert out["brier"] == pytest.approx(BRIER, abs=1e-12)


def test_evaluate_default_bins_is_15():
    # 15 bins of width 1/15: .45 -> bin 6 (.4, .4667], .5 -> bin 7 (.4667, .5333],
    # .7 -> bin 10 (.6667, .7333], .9 -> bin 13 (.8667, .9333]: every example alone,
    # ECE = (|1-.7| + |0-.5| + |1-.45| + |0-.9|) / 4 = (.3 + .5 + .55 + .9) / 4 = 0.5625
    assert metrics.evaluate(PROBS, TARGETS)["ece"] == pytest.approx(0.5625, abs=1e-12)
    assert metrics.ece(PROBS, TARGETS) == pytest.approx(0.5625, abs=1e-12)


def test_float32_input_matches():
    p32 = PROBS.float()
    assert metrics.nll(p32, TARGETS) == pytest.approx(NLL, abs=1e-6)
    assert metrics.brier(p32, TARGETS) == pytest.approx(BRIER, abs=1e-6)
    assert metrics.ece(p32, TARGETS, n_bins=5) == pytest.approx(ECE5, abs=1e-6)


def test_reliability_diagram_data_hand_computed():
    d = metrics.reliability_diagram_data(PROBS, TARGETS, n_bins=5)
    assert isinstance(d, ReliabilityData)
    _assert_nan_equal(d.bin_edges, [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    assert d.bin_count.tolist() == [0, 0, 2, 1, 1]  # bins 0 and 1 are empty
    _assert_nan_equal(d.bin_accuracy, [nan, nan, 0.5, 1.0, 0.0])
    _assert_nan_equal(d.bin_confidence, [nan, nan, 0.475, 0.7, 0.9])
    assert d.n_bins == 5 and d.n_examples == 4
    assert d.ece == pytest.approx(ECE5, abs=1e-12)


def test_predictive_entropy_hand_computed():
    h = metrics.predictive_entropy(PROBS)
    assert h.shape == (4,) and h.dtype == torch.float64
    assert float(h[0]) == pytest.approx(H0, abs=1e-7)
    # uniform over 3 classes -> ln 3 ; one-hot (with exact zeros) -> 0, no NaN from 0 log 0
    h2 = metrics.predictive_entropy(torch.tensor([[1 / 3, 1 / 3, 1 / 3], [0.0, 1.0, 0.0]]))
    assert float(h2[0]) == pytest.approx(math.log(3), abs=1e-6)
    assert float(h2[1]) == 0.0


# --------------------------------------------------------------------------- #
# Bayesian model average
# --------------------------------------------------------------------------- #
def test_bma_fixed_samples():
    # S=2, N=2, C=2
    #   sample 0: [[.8, .2], [.4, .6]]
    #   sample 1: [[.6, .4], [.0, 1.]]
    #   mean:     [[.7, .3], [.2, .8]]
    samples = torch.tensor([[[0.8, 0.2], [0.4, 0.6]],
                            [[0.6, 0.4], [0.0, 1.0]]], dtype=torch.float64)
    bma = metrics.bayesian_model_average(samples)
    assert bma.shape == (2, 2)
    assert torch.allclose(bma, torch.tensor([[0.7, 0.3], [0.2, 0.8]], dtype=torch.float64), atol=1e-12)


def test_bma_of_disagreeing_confident_models_improves_nll():
    # Two one-hot models that each get one of two examples right:
    #   model A: [[1,0],[1,0]], model B: [[0,1],[0,1]], targets [0, 1]
    #   BMA = [[.5,.5],[.5,.5]] -> nll = ln 2, while each model has an example with p=0.
    samples = torch.tensor([[[1.0, 0.0], [1.0, 0.0]],
                            [[0.0, 1.0], [0.0, 1.0]]])
    t = torch.tensor([0, 1])
    bma = metrics.bayesian_model_average(samples)
    assert metrics.nll(bma, t) == pytest.approx(math.log(2), abs=1e-6)
    # model A: -(ln 1 + ln eps)/2 = -ln(1e-12)/2 = 13.8155...
    assert metrics.nll(samples[0], t) == pytest.approx(-math.log(1e-12) / 2, rel=1e-6)


def test_bma_single_sample_is_identity_and_errors():
    assert torch.equal(metrics.bayesian_model_average(PROBS.unsqueeze(0)), PROBS)
    with pytest.raises(ValueError, match=r"\[S, N, C\]"):
        metrics.bayesian_model_average(PROBS)
    with pytest.raises(ValueError, match="S >= 1"):
        metrics.bayesian_model_average(torch.empty(0, 4, 3))
    bad = torch.stack([PROBS, PROBS * 2])
    with pytest.raises(ValueError, match="sum to 1"):
        metrics.bayesian_model_average(bad)
    with pytest.raises(TypeError, match="torch.Tensor"):
        metrics.bayesian_model_average([PROBS.tolist()])


# --------------------------------------------------------------------------- #
# Binning edge cases
# --------------------------------------------------------------------------- #
def test_confidence_exactly_on_bin_edge_goes_to_lower_bin():
    # 4 bins (0,.25] (.25,.5] (.5,.75] (.75,1]; all values exactly representable.
    #   conf .25 -> bin 0 (right-inclusive), .5 -> bin 1, .75 -> bin 2, 1.0 -> bin 3
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25],
                          [0.5, 0.5, 0.0, 0.0],
                          [0.75, 0.25, 0.0, 0.0],
                          [1.0, 0.0, 0.0, 0.0]])
    t = torch.tensor([0, 1, 0, 0])
    d = metrics.reliability_diagram_data(probs, t, n_bins=4)
    assert d.bin_count.tolist() == [1, 1, 1, 1]
    # row 0: argmax 0 == 0 correct; row 1: argmax 0 (tie -> lowest) != 1 wrong; rows 2,3 correct
    _assert_nan_equal(d.bin_accuracy, [1.0, 0.0, 1.0, 1.0])
    _assert_nan_equal(d.bin_confidence, [0.25, 0.5, 0.75, 1.0])
    # ECE = (|1-.25| + |0-.5| + |1-.75| + |1-1|) / 4 = (.75 + .5 + .25 + 0) / 4 = 0.375
    assert metrics.ece(probs, t, n_bins=4) == pytest.approx(0.375, abs=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_non_dyadic_edge_uses_dtype_of_probs(dtype):
    # 0.6 is not exact in binary; it must still land in bin 2 = (0.4, 0.6] of 5 bins,
    # and 0.4 in bin 1 = (0.2, 0.4], for both float32 and float64 inputs.
    probs = torch.tensor([[0.6, 0.4], [0.4, 0.6]], dtype=dtype)
    d = metrics.reliability_diagram_data(probs, torch.tensor([0, 0]), n_bins=5)
    assert d.bin_count.tolist() == [0, 0, 2, 0, 0]
    three = torch.tensor([[0.4, 0.3, 0.3]], dtype=dtype)
    d3 = metrics.reliability_diagram_data(three, torch.tensor([0]), n_bins=5)
    assert d3.bin_count.tolist() == [0, 1, 0, 0, 0]


def test_float64_confidence_just_above_edge_goes_to_upper_bin():
    # 0.6 < 0.6 + 1e-9 < float32(0.6) = 0.6000000238...: in float64 this is strictly above the
    # edge 3/5, so it belongs to bin 3 = (0.6, 0.8]; an edge rounded to float32 would misplace it.
    c = 0.6 + 1e-9
    probs = torch.tensor([[c, 1.0 - c]], dtype=torch.float64)
    d = metrics.reliability_diagram_data(probs, torch.tensor([0]), n_bins=5)
    assert d.bin_count.tolist() == [0, 0, 0, 1, 0]


def test_single_bin_ece_is_abs_accuracy_minus_mean_confidence():
    # 1 bin: ECE = |acc - mean conf| = |.5 - (.7+.5+.45+.9)/4| = |.5 - .6375| = .1375
    assert metrics.ece(PROBS, TARGETS, n_bins=1) == pytest.approx(0.1375, abs=1e-12)


def test_perfect_calibration_gives_zero_ece():
    # conf .75 for all 4 examples (same bin), 3 of 4 correct -> acc .75 == conf .75
    probs = torch.tensor([[0.75, 0.25]] * 4)
    t = torch.tensor([0, 0, 0, 1])
    assert metrics.ece(probs, t, n_bins=10) == pytest.approx(0.0, abs=1e-7)
    # one-hot and always right: ECE 0, NLL 0, Brier 0, accuracy 1
    onehot = torch.eye(3)
    out = metrics.evaluate(onehot, torch.arange(3))
    assert out == {"accuracy": 1.0, "nll": 0.0, "ece": 0.0, "brier": 0.0}


def test_ece_against_loop_reference():
    # Straightforward per-bin loop (Guo et al. reference) on fixed pseudo-random data.
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3.0 * torch.randn(200, 5, generator=g, dtype=torch.float64), dim=1)
    t = torch.randint(0, 5, (200,), generator=g)
    p = probs.numpy()
    conf, pred = p.max(1), p.argmax(1)
    correct = (pred == t.numpy()).astype(float)
    n_bins = 7
    expected = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        m = (conf > lo) & (conf <= hi)
        if m.any():
            expected += m.mean() * abs(correct[m].mean() - conf[m].mean())
    assert metrics.ece(probs, t, n_bins=n_bins) == pytest.approx(expected, abs=1e-12)
    onehot = np.eye(5)[t.numpy()]
    assert metrics.brier(probs, t) == pytest.approx(((p - onehot) ** 2).sum(1).mean(), abs=1e-12)
    assert metrics.nll(probs, t) == pytest.approx(-np.log(p[np.arange(200), t.numpy()]).mean(), abs=1e-12)


def test_nll_eps_clamp():
    probs = torch.tensor([[1.0, 0.0]])
    t = torch.tensor([1])
    assert metrics.nll(probs, t, eps=1e-4) == pytest.approx(-math.log(1e-4), abs=1e-9)
    assert metrics.nll(probs, t, eps=0.0) == math.inf
    with pytest.raises(ValueError, match="eps"):
        metrics.nll(probs, t, eps=-1.0)


def test_metrics_do_not_require_grad_and_entropy_is_differentiable():
    logits = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    probs = torch.softmax(logits, dim=1)
    t = torch.tensor([0, 1, 2])
    assert type(metrics.nll(probs, t)) is float
    metrics.predictive_entropy(probs).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


# --------------------------------------------------------------------------- #
# Validation errors
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize(
    "probs, exc, pattern",
    [
        (PROBS.tolist(), TypeError, "torch.Tensor"),
        (torch.tensor([[1, 0], [0, 1]]), TypeError, "floating-point"),
        (torch.tensor([0.5, 0.5]), ValueError, r"2-D.*\(2,\)"),
        (torch.empty(0, 3), ValueError, "at least one example"),
        (torch.tensor([[0.5, 0.4], [0.5, 0.5]]), ValueError, r"row 0 sums to 0\.9"),
        (torch.tensor([[1.2, -0.2], [0.5, 0.5]]), ValueError, r"non-negative.*\[0, 1\] = -0\.2"),
        (torch.tensor([[nan, 1.0], [0.5, 0.5]]), ValueError, "finite"),
        (torch.tensor([[2.0, 3.0], [0.5, 0.5]]), ValueError, "not logits"),
    ],
)
def test_bad_probs_raise(probs, exc, pattern):
    t = torch.tensor([0, 1])
    for fn in (metrics.nll, metrics.accuracy, metrics.brier, metrics.ece,
               metrics.reliability_diagram_data, metrics.evaluate):
        with pytest.raises(exc, match=pattern):
            fn(probs, t)
    with pytest.raises(exc, match=pattern):
        metrics.predictive_entropy(probs)


def test_row_sum_tolerance_is_1e_2_whatever_the_dtype():
    """A bfloat16/float16 softmax cast to float32 for evaluation (rows off by ~2e-3) was refused at 1e-4."""
    ok = torch.tensor([[0.5, 0.5 + 5e-3]], dtype=torch.float64)
    metrics.nll(ok, torch.tensor([0]))
    half = torch.softmax((3 * torch.randn(256, 10, generator=torch.Generator().manual_seed(0))).bfloat16(), -1)
    metrics.evaluate(half.float(), torch.zeros(256, dtype=torch.long))
    near = torch.tensor([[0.5, 0.52]], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"sum to 1 \(within 0.01\), but row 0 sums to 1.02; renormalise"):
        metrics.nll(near, torch.tensor([0]))
    with pytest.raises(ValueError, match="not logits"):
        metrics.nll(torch.tensor([[2.0, 3.0]]), torch.tensor([0]))


def test_a_non_finite_entry_is_named_alone_and_a_sure_prediction_has_zero_nll():
    p = torch.full((2, 50000), 2e-5)
    p[1, 7] = float("nan")
    with pytest.raises(ValueError) as info:
        metrics.nll(p, torch.zeros(2, dtype=torch.long))
    assert "probs[1, 7] = nan" in str(info.value) and len(str(info.value)) < 200  # (it printed the whole row)
    assert str(metrics.nll(torch.eye(2), torch.arange(2))) == "0.0"  # (it was -0.0)


@pytest.mark.parametrize(
    "targets, exc, pattern",
    [
        ([0, 2, 2, 0], TypeError, "torch.Tensor"),
        (torch.tensor([0.0, 2.0, 2.0, 0.0]), TypeError, "torch.long.*torch.float32"),
        (torch.tensor([0, 2, 2, 0], dtype=torch.int32), TypeError, "torch.long"),
        (torch.tensor([[0, 2, 2, 0]]), ValueError, r"1-D.*\(1, 4\)"),
        (torch.tensor([0, 2, 2]), ValueError, "length N=4.*got 3"),
        (torch.tensor([0, 2, 3, 0]), ValueError, r"\[0, 3\), got value 3"),
        (torch.tensor([0, -1, 2, 0]), ValueError, r"\[0, 3\), got value -1"),
    ],
)
def test_bad_targets_raise(targets, exc, pattern):
    for fn in (metrics.nll, metrics.accuracy, metrics.brier, metrics.ece,
               metrics.reliability_diagram_data, metrics.evaluate):
        with pytest.raises(exc, match=pattern):
            fn(PROBS, targets)


@pytest.mark.parametrize(
    "n_bins, exc",
    [(0, ValueError), (-3, ValueError), (2.5, TypeError), ("5", TypeError), (True, TypeError), (None, TypeError)],
)
def test_bad_n_bins_raise(n_bins, exc):
    for fn in (metrics.ece, metrics.reliability_diagram_data, metrics.evaluate):
        with pytest.raises(exc, match="n_bins"):
            fn(PROBS, TARGETS, n_bins=n_bins)


def test_numpy_int_n_bins_accepted():
    assert metrics.ece(PROBS, TARGETS, n_bins=np.int64(5)) == pytest.approx(ECE5, abs=1e-12)


# --------------------------------------------------------------------------- #
# Plotting
# --------------------------------------------------------------------------- #
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_save_reliability_diagram_single_and_multi(tmp_path):
    pytest.importorskip("matplotlib")
    from torchsso2.plotting import save_reliability_diagram

    d = metrics.reliability_diagram_data(PROBS, TARGETS, n_bins=5)
    single = tmp_path / "single.png"
    assert save_reliability_diagram(d, single) == single
    assert single.read_bytes()[:8] == PNG_SIGNATURE

    perfect = metrics.reliability_diagram_data(torch.tensor([[0.75, 0.25]] * 4), torch.tensor([0, 0, 0, 1]), 5)
    multi = tmp_path / "multi.png"
    save_reliability_diagram({"MAP": d, "VI (BMA)": perfect}, str(multi), title="Calibration")
    data = multi.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    # IHDR width (bytes 16..20, big-endian): two panels are wider than one.
    assert int.from_bytes(data[16:20], "big") > int.from_bytes(single.read_bytes()[16:20], "big")


def test_save_reliability_diagram_bad_input(tmp_path):
    pytest.importorskip("matplotlib")
    from torchsso2.plotting import save_reliability_diagram

    with pytest.raises(ValueError, match="non-empty"):
        save_reliability_diagram({}, tmp_path / "x.png")
    with pytest.raises(TypeError, match="ReliabilityData"):
        save_reliability_diagram({"a": {"bin_count": [1]}}, tmp_path / "x.png")
    with pytest.raises(TypeError, match="ReliabilityData"):
        save_reliability_diagram([1, 2], tmp_path / "x.png")
    d = metrics.reliability_diagram_data(PROBS, TARGETS, n_bins=5)
    with pytest.raises(ValueError, match="two panels named '1'"):  # one hid the other
        save_reliability_diagram({1: d, "1": d}, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
    # the suffix picks the format (a .pdf held PNG bytes); a suffix no format has (a dotted name) is PNG
    assert save_reliability_diagram(d, tmp_path / "d.pdf").read_bytes()[:5] == b"%PDF-"
    assert save_reliability_diagram(d, tmp_path / "rel_lr0.1").read_bytes()[:8] == PNG_SIGNATURE


def test_save_reliability_diagram_without_matplotlib(tmp_path, monkeypatch):
    from torchsso2.plotting import save_reliability_diagram

    # Simulate a missing matplotlib: a None entry in sys.modules makes the import fail.
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)
    d = metrics.reliability_diagram_data(PROBS, TARGETS, n_bins=5)
    with pytest.raises(ImportError, match=r"pip install matplotlib"):
        save_reliability_diagram(d, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# --------------------------------------------------------------------------- #
# Tie-breaking and edges shared by several rounded bin edges (mutation-audit gaps)
# --------------------------------------------------------------------------- #
def test_accuracy_ties_go_to_lowest_class_index_as_sklearn():
    # Docstring: ties are broken towards the lowest class index. Reference: sklearn's
    # accuracy_score on np.argmax (first maximum). Rows 0, 2, 3 are ties: lowest index gives
    # rows 0, 1, 3 right -> 3/4; a highest-index rule gives rows 1, 2 right -> 2/4.
    from sklearn.metrics import accuracy_score

    p = torch.tensor([[0.4, 0.4, 0.2], [0.25, 0.25, 0.5], [0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]],
                     dtype=torch.float64)
    t = torch.tensor([0, 2, 1, 0])
    want = accuracy_score(t.numpy(), np.argmax(p.numpy(), axis=1))
    assert want == 0.75
    assert metrics.accuracy(p, t) == want
    assert metrics.evaluate(p, t)["accuracy"] == want


def _exact_bin(c, n_bins):
    # Right-inclusive bins in exact rational arithmetic: bin b holds b/n < c <= (b+1)/n.
    from fractions import Fraction

    return max(0, math.ceil(Fraction(float(c)) * n_bins) - 1)


def test_bfloat16_confidence_on_edge_shared_by_rounded_edges_uses_float64_rule():
    # bfloat16 with 1000 bins: several inner edges k/1000 (e.g. 749/1000, 751/1000) round to the
    # same bfloat16 value 0.75, so the documented rule compares in float64: 0.75 <= 750/1000
    # -> bin 749 (right-inclusive), 0.5 -> bin 499. Reference: exact Fraction arithmetic.
    n_bins = 1000
    inner_bf = (torch.arange(1, n_bins, dtype=torch.float64) / n_bins).to(torch.bfloat16)
    assert int((inner_bf == 0.75).sum()) > 1  # the premise: 0.75 is a shared rounded edge
    probs = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.25, 0.75]], dtype=torch.bfloat16)
    d = metrics.reliability_diagram_data(probs, torch.tensor([0, 1, 1]), n_bins)
    want = sorted(_exact_bin(c, n_bins) for c in probs.double().max(1).values)
    assert want == [499, 749, 749]
    got = sorted(int(i) for i in torch.nonzero(d.bin_count).flatten() for _ in range(int(d.bin_count[i])))
    assert got == want


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_ece_matches_exact_binning_reference_in_each_dtype(dtype):
    # Random confidences (many of them on rounded edges in the 16-bit dtypes) against a per-example
    # reference of the documented rule: a confidence equal to the dtype-rounded edge k/n (rounded
    # from that edge only) goes to bin k-1, any other one to ceil(c*n)-1 in exact Fraction
    # arithmetic (right-inclusive); sums in float64, so 1e-12 is rounding only.
    g = torch.Generator().manual_seed(0)
    for nb in (10, 15, 7):
        logits = torch.randn(400, 4, generator=g, dtype=torch.float64) * 2
        pr = torch.softmax(logits, -1).to(dtype)
        tg = torch.randint(0, 4, (400,), generator=g)
        conf, pred = pr.max(1)
        rounded = [float(torch.tensor(k / nb, dtype=torch.float64).to(dtype)) for k in range(1, nb)]
        edges_dt = {v: k for k, v in enumerate(rounded, start=1) if rounded.count(v) == 1}
        cnt, cs, ac = np.zeros(nb), np.zeros(nb), np.zeros(nb)
        for c, pd, y in zip(conf.double().tolist(), pred.tolist(), tg.tolist()):
            b = edges_dt[c] - 1 if c in edges_dt else _exact_bin(c, nb)
            cnt[b] += 1
            cs[b] += c
            ac[b] += pd == y
        nz = cnt > 0
        ref = float((cnt[nz] / cnt.sum() * np.abs(ac[nz] / cnt[nz] - cs[nz] / cnt[nz])).sum())
        assert metrics.ece(pr, tg, nb) == pytest.approx(ref, abs=1e-12), (dtype, nb)


def test_brier_squares_low_precision_probabilities_in_float64():
    """Squared in the input's dtype, a confident bfloat16 row over 1000 classes read 78% high."""
    p = torch.full((1, 1000), 0.046875 / 999, dtype=torch.float64)
    p[0, 0] = 0.953125
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        low = p.to(dtype)
        assert metrics.brier(low, torch.tensor([0])) == pytest.approx(metrics.brier(low.double(), torch.tensor([0])),
                                                                      rel=1e-12)
