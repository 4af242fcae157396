"""The machine's drift over a study, from one control setting measured again and again.

The search measures one setting at a time, minutes apart, so a machine that
slows down (or speeds up) over the study would make early settings look better
than late ones. The search phase therefore measures a control setting (the
baseline) every ``tune.control_every`` trials. A straight line through the
logs of the control's values against time says how fast the machine moved;
when its slope is beyond the noise (Student's t at 97.5 % on the line's own
residuals), each measurement outside the side-by-side rounds is divided by
the line's value at its time (relative to the controls' mean time) before the
search's finalists are chosen. When the slope is within the noise nothing is
corrected: a correction from noise would only add noise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from .paired import t_quantile


@dataclass(frozen=True)
class Drift:
    """The line through the control's measurements, log value against seconds."""

    start_s: float  # when the first control ran (seconds since the epoch)
    times_s: tuple[float, ...]  # when each control ran (seconds since the first)
    values: tuple[float, ...]
    slope: float  # log units per second
    slope_se: float | None
    center_s: float  # the controls' mean time: the correction's reference
    residual_sigma: float | None  # the controls' scatter about the line (log)

    @property
    def significant(self) -> bool:
        """The slope is beyond the noise."""
        if self.slope_se is None:
            return False
        return abs(self.slope) > t_quantile(len(self.values) - 2) * self.slope_se

    @property
    def change(self) -> float:
        """The line's change over the controls' span (0.1 = 10 % faster at the end)."""
        return math.expm1(self.slope * (self.times_s[-1] - self.times_s[0]))

    @property
    def spread(self) -> float:
        """The controls' range as a share of their lowest (0.1 = the highest 10 % above)."""
        return max(self.values) / min(self.values) - 1

    def factor(self, time_s: float) -> float:
        """The machine's speed at ``time_s`` (seconds since the epoch) relative to the
        controls' mean time (1.0 when the slope is within the noise): divide a
        measurement made then by it."""
        if not self.significant:
            return 1.0
        return math.exp(self.slope * (time_s - self.start_s - self.center_s))


def drift_of(points: Sequence[tuple[float, float]]) -> Drift | None:
    """The drift from (time in seconds since the epoch, value) measurements of one setting; None below
    three (a line through two has no noise to judge it by)."""
    points = sorted((t, v) for t, v in points if v > 0)
    if len(points) < 3:
        return None
    start = points[0][0]
    times = [t - start for t, _ in points]
    logs = [math.log(v) for _, v in points]
    center, mean = statistics.fmean(times), statistics.fmean(logs)
    spread = sum((t - center) ** 2 for t in times)
    slope = sum((t - center) * (y - mean) for t, y in zip(times, logs, strict=True)) / spread
    residual = [y - mean - slope * (t - center) for t, y in zip(times, logs, strict=True)]
    sigma = math.sqrt(sum(r * r for r in residual) / (len(points) - 2))
    return Drift(
        start_s=start,
        times_s=tuple(times),
        values=tuple(v for _, v in points),
        slope=slope,
        slope_se=sigma / math.sqrt(spread) if spread > 0 else None,
        center_s=center,
        residual_sigma=sigma,
    )
