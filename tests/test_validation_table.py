"""Every row of docs/validation.md: the documented bad input raises the documented error."""
from __future__ import annotations

import pathlib
from typing import List, Tuple

import pytest
import torch
import torch.nn as nn

import curvature
from torchsso2 import SecondOrderOptimizer, VIOptimizer
from torchsso2.kfac import KFACPreconditioner

TABLE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "validation.md"


def _rows() -> List[Tuple[str, str, str, str, str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in ("SecondOrderOptimizer", "VIOptimizer", "KFACPreconditioner", "compute"):
            rows.append(tuple(cells))
    return rows


ROWS = _rows()


def test_table_is_not_empty():
    assert len(ROWS) >= 50


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


@pytest.mark.parametrize("face,arg,value,error,text", ROWS, ids=[f"{r[0]}-{r[1]}-{r[2]}" for r in ROWS])
def test_row(face, arg, value, error, text):
    bad = eval(value, {"torch": torch, "nn": nn, "float": float, "object": object})  # noqa: S307 (doc table)
    exc = {"ValueError": ValueError, "TypeError": TypeError}[error]
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    with pytest.raises(exc) as info:
        if face == "compute":
            kwargs = {"kind": "fisher", "approx": "full"}
            targets, inputs = y, x
            if arg == "targets":
                targets = bad
            elif arg == "inputs":
                inputs = bad
            else:
                kwargs[arg] = bad
            curvature.compute(_model(), inputs, targets, **kwargs)
        else:
            cls = {"SecondOrderOptimizer": SecondOrderOptimizer, "VIOptimizer": VIOptimizer,
                   "KFACPreconditioner": KFACPreconditioner}[face]
            kwargs = {"dataset_size": 10} if cls is VIOptimizer else {}
            if arg == "model":
                model = bad
            else:
                model = _model()
                kwargs[arg] = bad
            cls(model, **kwargs)
    assert text in str(info.value), f"message {str(info.value)!r} does not contain {text!r}"
