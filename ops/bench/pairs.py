"""What a worker setting costs in CPU per event, from end-to-end runs paired by round.

On a shared 2-core machine equal runs differ by 10-50 % in worker CPU per event and the machine drifts over
minutes, so a cost of a few per cent shows only in the difference of runs made next to each other.
``sluice bench e2e --rounds K`` runs its cases K times, each round in the reverse order of the one before
(ABBA: a steady drift cancels), and each round's run with a telemetry setting is paired with the same
round's run of the same case without it. Closer still, ``--telemetry 'none|admin'`` runs two workers side
by side on the same jobs, one of each setting, through the same minutes of the machine: each run is a pair
(each worker's CPU over the contract events of the requests it ran). The cost is the median of the pairs'
differences, with a distribution-free confidence interval for that median (the sign test's order
statistics): one disturbed run cannot decide it, and the interval says how small a cost the runs could
have shown.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["LEVEL", "median_interval", "telemetry_costs"]

LEVEL = 0.95


def median_interval(values: Sequence[float], level: float = LEVEL) -> tuple[float, float] | None:
    """A confidence interval of at least ``level`` for the median of the population ``values`` come from:
    ``[x(j), x(n+1-j)]`` of the sorted values, ``j`` the largest with P(B < j) <= (1 - level) / 2, B the
    binomial(n, 1/2) count of values under the median. None when there are too few values for ``level``
    (fewer than 6 at 95 %)."""
    xs = sorted(values)
    n = len(xs)
    tail = (1 - level) / 2
    j, below = 0, 0.0
    for k in range(n + 1):
        below += math.comb(n, k) / 2**n  # P(B <= k)
        if below > tail:
            break
        j = k + 1
    if j == 0:
        return None
    return xs[j - 1], xs[n - j]


def _case(result: dict[str, Any]) -> str:
    """The case a run belongs to: its label without the telemetry setting (kept when side by side: such a run
    pairs within itself, and not with separate runs)."""
    tel = str(result.get("telemetry", "none"))
    label = str(result.get("label", ""))
    return label if tel == "none" or "|" in tel else label.replace(f" telemetry={tel}", "")


def telemetry_costs(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case and telemetry setting other than ``none``: the rounds' pairs (the setting's worker CPU per
    event minus the same round's ``none`` run of the case), their median, its interval and the median
    relative to the ``none`` runs' median. Runs without a CPU figure, or without their pair, are left out."""
    runs: dict[tuple[str, int, str], float] = {}
    for r in results:
        if sides := r.get("sides"):  # side by side: the run is its own pair, "none" and the setting at once
            for side in sides:
                if side.get("worker_cpu_us_per_event") is not None:
                    runs[(_case(r), int(r.get("round", 0)), side["telemetry"])] = float(side["worker_cpu_us_per_event"])
        elif (us := r.get("worker_cpu_us_per_event")) is not None:
            runs[(_case(r), int(r.get("round", 0)), str(r.get("telemetry", "none")))] = float(us)
    out = []
    for case, tel in sorted({(c, t) for c, _, t in runs if t != "none"}):
        rounds = sorted(n for c, n, t in runs if (c, t) == (case, tel) and (case, n, "none") in runs)
        if not rounds:
            continue
        base = [runs[(case, n, "none")] for n in rounds]
        diffs = [runs[(case, n, tel)] - runs[(case, n, "none")] for n in rounds]
        median, ref = statistics.median(diffs), statistics.median(base)
        interval = median_interval(diffs)
        out.append(
            {
                "case": case,
                "telemetry": tel,
                "pairs": len(diffs),
                "none_median_us_per_event": ref,
                "diffs_us_per_event": diffs,
                "median_diff_us_per_event": median,
                "median_diff_relative": median / ref if ref else None,
                "interval_us_per_event": list(interval) if interval else None,
                "interval_relative": [x / ref for x in interval] if interval and ref else None,
                "level": LEVEL,
            }
        )
    return out
