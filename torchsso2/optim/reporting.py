"""Rate limits for repeated log lines (a diverged run must not print one line per skipped step)."""
from __future__ import annotations


def worth_reporting(count: int) -> bool:
    """True for the 1st, 2nd, 5th, 10th, 20th, 50th, 100th, ... occurrence (a 1-2-5 series)."""
    if count < 1:
        return False
    while count % 10 == 0:
        count //= 10
    return count in (1, 2, 5)
