"""Settings compared side by side: measured in rounds, judged by paired ratios.

A round measures several settings one after another, a minute or two in all;
between rounds the machine drifts (other work, a warmer chip, a busier disk)
far more than within one. Each measurement's log is modelled as its setting's
effect plus its round's effect plus noise:

    log v[s, r] = mu[s] + beta[r] + e,    e ~ N(0, sigma^2)

fitted by least squares over every round (a setting dropped from a race is
simply absent from later rounds). A slow round moves every setting in it alike
and beta takes it; the difference mu[a] - mu[b] is then the two settings' paired
log-ratio, with a standard error from sigma and the rounds they share (the fit's
covariance). sigma comes from the residuals, with N - settings - rounds + 1
degrees of freedom, and a difference is claimed beyond Student's t at 97.5 %
for those (two-sided 95 %): with few rounds the noise itself is uncertain, and a
normal quantile would claim too much. Where one setting is held against k others
at once (the race's best against the rest), the bound is Bonferroni's, t at
1 - 0.025 / k, so that the k claims together are wrong 5 % of the time, not each.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np

Key = Hashable

@functools.lru_cache(maxsize=256)
def t_quantile(df: int, comparisons: int = 1) -> float:
    """Student's t with ``df`` degrees of freedom at 1 - 0.025 / ``comparisons`` (97.5 %
    for one claim): its density integrated (Simpson) and the integral inverted by
    bisection; the normal quantile above 1000 degrees of freedom."""
    if df < 1:
        return math.inf
    p = 1 - 0.025 / max(1, comparisons)
    if df > 1000:
        return statistics.NormalDist().inv_cdf(p)
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def density(x: float) -> float:
        return scale * (1 + x * x / df) ** (-(df + 1) / 2)

    def below(x: float, parts: int = 2000) -> float:  # P(T <= x) for x >= 0
        h = x / parts
        inner = sum((4 if i % 2 else 2) * density(i * h) for i in range(1, parts))
        return 0.5 + h / 3 * (density(0.0) + inner + density(x))

    low, high = 0.0, 1.0
    while below(high) < p:
        low, high = high, high * 2
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if below(middle) < p else (low, middle)
    return (low + high) / 2


@dataclass(frozen=True)
class PairedFit:
    """The additive fit of settings and rounds (see the module's docstring)."""

    keys: tuple[Key, ...]
    effects: tuple[float, ...]  # mu of each key (log scale; only differences mean anything)
    covariance: np.ndarray = field(repr=False)  # of the effects, in units of sigma^2
    sigma: float | None  # one measurement's noise on the log scale (None: no residual df)
    df: int
    offset: float  # the mean round effect: level = exp(mu + offset)
    counts: dict[Key, int]  # measurements of each key
    rounds: dict[str, float]  # each round's effect (log), the first one 0

    @classmethod
    def of(cls, rows: Iterable[tuple[Key, str, float]]) -> PairedFit | None:
        """Fit (setting, round, value) rows; None when there is nothing to fit."""
        rows = [(key, block, value) for key, block, value in rows if value > 0]
        if not rows:
            return None
        keys = tuple(dict.fromkeys(key for key, _, _ in rows))
        blocks = tuple(dict.fromkeys(block for _, block, _ in rows))
        column = {key: i for i, key in enumerate(keys)}
        block_column = {block: len(keys) + i - 1 for i, block in enumerate(blocks) if i}
        design = np.zeros((len(rows), len(keys) + len(blocks) - 1))
        y = np.empty(len(rows))
        for i, (key, block, value) in enumerate(rows):
            design[i, column[key]] = 1.0
            if block in block_column:
                design[i, block_column[block]] = 1.0
            y[i] = math.log(value)
        coef, _, rank, _ = np.linalg.lstsq(design, y, rcond=None)
        residual = y - design @ coef
        df = len(rows) - int(rank)
        sigma = math.sqrt(float(residual @ residual) / df) if df > 0 else None
        covariance = np.linalg.pinv(design.T @ design)[: len(keys), : len(keys)]
        block_effects = {blocks[0]: 0.0, **{b: float(coef[c]) for b, c in block_column.items()}}
        counts: dict[Key, int] = {}
        for key, _, _ in rows:
            counts[key] = counts.get(key, 0) + 1
        return cls(
            keys=keys,
            effects=tuple(float(c) for c in coef[: len(keys)]),
            covariance=covariance,
            sigma=sigma,
            df=df,
            offset=float(np.mean(list(block_effects.values()))),
            counts=counts,
            rounds=block_effects,
        )

    def __contains__(self, key: Key) -> bool:
        return key in self.counts

    def effect(self, key: Key) -> float:
        return self.effects[self.keys.index(key)]

    def level(self, key: Key) -> float:
        """``key``'s value (samples/s) in an average round of the fit."""
        return math.exp(self.effect(key) + self.offset)

    def ratio(self, a: Key, b: Key) -> float:
        """a / b, paired within rounds."""
        return math.exp(self.effect(a) - self.effect(b))

    def se(self, a: Key, b: Key) -> float | None:
        """The standard error of log(a / b); None while the noise is unknown."""
        if a == b:
            return None if self.sigma is None else 0.0
        return self.contrast({a: 1.0, b: -1.0})[1]

    def contrast(self, weights: dict[Key, float]) -> tuple[float, float | None]:
        """sum(w * mu) over ``weights`` (weights summing to 0: a log-ratio of products,
        free of the rounds) and its standard error (None while the noise is unknown)."""
        w = np.zeros(len(self.keys))
        for key, weight in weights.items():
            w[self.keys.index(key)] += weight
        estimate = float(w @ np.array(self.effects))
        if self.sigma is None:
            return estimate, None
        return estimate, self.sigma * math.sqrt(max(0.0, float(w @ self.covariance @ w)))

    @property
    def bound(self) -> float:
        """How many standard errors a claimed difference exceeds: t(df) at 97.5 %."""
        return t_quantile(self.df)

    def beats(self, a: Key, b: Key, comparisons: int = 1) -> bool:
        """Whether ``a`` is above ``b`` beyond the noise (``comparisons``: of that many
        claims made together, Bonferroni's bound)."""
        se = self.se(a, b)
        bound = t_quantile(self.df, comparisons)
        return se is not None and self.effect(a) - self.effect(b) > bound * se

    def differs(self, a: Key, b: Key, comparisons: int = 1) -> bool:
        return self.beats(a, b, comparisons) or self.beats(b, a, comparisons)
