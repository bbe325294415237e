"""Verdicts that a busy machine cannot flip: counts decide where a claim is about counts, and
timings decide only with a margin beyond their own noise.

A claim about sequential steps, arithmetic or memory is measured as an exact count (the same on
every run, whatever else the machine does). A claim about time is measured by
:func:`time_interleaved` (every case once per round, so a burst of load hits all of them alike;
the minimum over rounds, since load only ever adds time) and judged by :func:`decide`, which
answers one of three things:

- :data:`HELD`: the measured value lies inside the claim's band, by more than its noise;
- :data:`FAILED`: it lies outside a wider band (the claim's plus a margin), by more than its noise:
  the measurement contradicts the claim;
- :data:`NOT_SHOWN`: anything between: the effect is not larger than the noise on this machine.

The noise of a value derived from timings (a ratio, a fitted exponent) is how far it moves when it
is computed from the first half of the rounds alone, or the second half alone (:class:`Timings`):
two measurements taken moments apart, under whatever load there was.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Sequence, Tuple, TypeVar

K = TypeVar("K", bound=Hashable)

HELD = "held"
NOT_SHOWN = "not shown"
FAILED = "did not hold"
STATES = (HELD, NOT_SHOWN, FAILED)

MARGIN = 0.25
"""How much larger than the claim's threshold a timed ratio must be (25%, beyond its noise) to
count either way; a 10% difference between two kernels never decides a verdict."""


def time_interleaved(cases: Mapping[K, Callable[[], object]], repeats: int,
                     clock: Callable[[], float] = time.thread_time,
                     between: Optional[Callable[[], None]] = None) -> Dict[K, List[float]]:
    """Seconds of ``clock`` for each call of each case: one warm-up call each, then ``repeats``
    rounds that call every case once, in order (interleaved, so load that comes and goes is shared).

    The default clock is the calling thread's CPU time, which other processes do not advance.
    ``between`` runs after each round (a progress bar)."""
    if repeats < 2:
        raise ValueError(f"repeats={repeats}: need at least 2 rounds, so that the noise can be estimated")
    for fn in cases.values():
        fn()
    samples: Dict[K, List[float]] = {key: [] for key in cases}
    for _ in range(repeats):
        for key, fn in cases.items():
            t0 = clock()
            fn()
            samples[key].append(clock() - t0)
        if between is not None:
            between()
    return samples


@dataclass(frozen=True)
class Timings:
    """Interleaved samples per case (from :func:`time_interleaved`, or synthetic in tests)."""

    samples: Mapping[Hashable, Sequence[float]]

    def best(self) -> Dict[Hashable, float]:
        """The minimum of each case over every round: the least disturbed run."""
        return {k: min(v) for k, v in self.samples.items()}

    def halves(self) -> Tuple[Dict[Hashable, float], Dict[Hashable, float]]:
        """The minimum of each case over the first half of the rounds, and over the second half."""
        first = {k: min(v[: max(1, len(v) // 2)]) for k, v in self.samples.items()}
        second = {k: min(v[max(1, len(v) // 2):]) for k, v in self.samples.items()}
        return first, second

    def value(self, of: Callable[[Mapping[Hashable, float]], float]) -> Tuple[float, float]:
        """``(value, noise)``: ``of`` applied to the best times, and how far it moves when applied to
        either half of the rounds alone."""
        v = of(self.best())
        noise = max(abs(of(h) - v) for h in self.halves())
        return v, noise


def decide(value: float, noise: float, holds: Tuple[float, float], fails_outside: Tuple[float, float]) -> str:
    """:data:`HELD` when all of ``value ± noise`` lies inside ``holds``; :data:`FAILED` when all of
    it lies outside ``fails_outside`` (which contains ``holds``: the band plus a margin);
    :data:`NOT_SHOWN` otherwise. A non-finite value or noise decides nothing."""
    lo, hi = holds
    flo, fhi = fails_outside
    if not (flo <= lo <= hi <= fhi):
        raise ValueError(f"holds={holds} must lie inside fails_outside={fails_outside}")
    if not (math.isfinite(value) and math.isfinite(noise)) or noise < 0:
        return NOT_SHOWN
    if lo <= value - noise and value + noise <= hi:
        return HELD
    if value + noise < flo or value - noise > fhi:
        return FAILED
    return NOT_SHOWN


def decide_ratio(ratio: float, noise: float, at_least: float, contradicted_below: float = 1.0,
                 margin: float = MARGIN) -> str:
    """A timed claim "``ratio`` is at least ``at_least``" (for example, a slower case's time over a
    faster one's), judged on a log scale: held above ``at_least·(1+margin)``, contradicted below
    ``contradicted_below/(1+margin)``, each by more than the noise. ``noise`` is absolute, in the
    units of ``ratio`` (as :meth:`Timings.value` gives it)."""
    if not (ratio > 0 and math.isfinite(ratio)) or not 0 <= noise < ratio:
        return NOT_SHOWN
    log_noise = math.log(ratio / (ratio - noise))  # the wider side of ratio ± noise, on a log scale
    m = math.log1p(margin)
    return decide(math.log(ratio), log_noise, (math.log(at_least) + m, math.inf),
                  (math.log(contradicted_below) - m, math.inf))


def combine(states: Sequence[str]) -> str:
    """One state for several parts of a claim: any part contradicted → :data:`FAILED`; else any
    part not shown → :data:`NOT_SHOWN`; else :data:`HELD`."""
    bad = [s for s in states if s not in STATES]
    if bad:
        raise ValueError(f"unknown state {bad[0]!r}; use one of {', '.join(STATES)}")
    if FAILED in states:
        return FAILED
    if NOT_SHOWN in states:
        return NOT_SHOWN
    return HELD


def load_average() -> Optional[float]:
    """This machine's 1-minute load average, or None where the system does not report one."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


__all__ = ["FAILED", "HELD", "MARGIN", "NOT_SHOWN", "STATES", "Timings", "combine", "cores", "decide",
           "decide_ratio", "load_average", "time_interleaved"]
