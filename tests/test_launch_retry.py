"""``dist_utils.launch_example`` re-runs a job once when a rank died of gloo's teardown abort after
finishing, and fails on anything else (or on that abort twice)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
from dist_utils import GLOO_TEARDOWN_ABORT, launch_example

SCRIPT = """import sys, pathlib
count = pathlib.Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
print("final test accuracy: 50.00%", flush=True)
if n <= int(sys.argv[2]):
    sys.stderr.write({abort!r} + "\\n")
    sys.exit(134)
"""


@pytest.mark.parametrize("aborts, ok", [(0, True), (1, True), (2, False)])
def test_teardown_abort_is_retried_once(tmp_path: Path, aborts: int, ok: bool) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT.format(abort=GLOO_TEARDOWN_ABORT))
    count = tmp_path / "count"  # an absolute script path: REPO / script is the script itself
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if ok:
            assert "final test accuracy" in launch_example([sys.executable], str(script), str(count), str(aborts))
        else:
            with pytest.raises(AssertionError, match="exited 134"):
                launch_example([sys.executable], str(script), str(count), str(aborts))
    assert len([w for w in seen if "running it once more" in str(w.message)]) == min(aborts, 1)
    assert int(count.read_text()) == min(aborts, 1) + 1


def test_other_failures_are_not_retried(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nprint('final test accuracy: 1%')\nsys.exit(3)\n")
    with pytest.raises(AssertionError, match="exited 3"):
        launch_example([sys.executable], str(script))
