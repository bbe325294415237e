"""Summaries of many judged cases: counts, refusals by reason, failures grouped by kind.

A failure group is one check (``Finding.kind``) on one backend. For each group the summary
gives its smallest case as the reproducer and the features every case of the group shares
(from :meth:`.calls.Spec.tags`), which usually names the bug's trigger.
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from typing import Iterable

from .judge import Result, normalise

SEED_ENV, CASES_ENV = "QKV_FUZZ_SEED", "QKV_FUZZ_CASES"


def base_seed() -> int:
    """``$QKV_FUZZ_SEED``, else one derived from the tests' base seed (tests/seeds.py: fixed
    under ``make test``, fresh in a plain run and shared by the pytest-xdist workers)."""
    env = os.environ.get(SEED_ENV)
    if env:
        return int(env)
    from .. import seeds

    return seeds.derive("fuzz")


@dataclass
class Group:
    kind: str
    backend: str
    cases: list[Result] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    @property
    def smallest(self) -> Result:
        return min(self.cases, key=lambda r: (r.size, len(r.describe)))


def group_failures(results: Iterable[Result]) -> list[Group]:
    groups: dict[tuple[str, str], Group] = {}
    for r in results:
        seen = set()
        for f in r.findings:
            key = (f.kind, f.backend)
            if key in seen:
                continue
            seen.add(key)
            g = groups.setdefault(key, Group(f.kind, f.backend))
            g.cases.append(r)
            g.details.append(f.detail)
    return sorted(groups.values(), key=lambda g: (-len(g.cases), g.backend, g.kind))


def common_tags(group: Group, everyone: list[Result], limit: int = 8) -> list[str]:
    """Tags every case of the group has but not every case overall, rarest overall first."""
    overall = collections.Counter(t for r in everyone for t in set(r.tags))
    n = len(everyone)
    shared = set(group.cases[0].tags)
    for r in group.cases[1:]:
        shared &= set(r.tags)
    shared = {t for t in shared if overall[t] < n and not t.startswith("backend=")}
    return sorted(shared, key=lambda t: overall[t])[:limit]


def refusals(results: Iterable[Result]) -> collections.Counter:
    c: collections.Counter = collections.Counter()
    for r in results:
        if r.status == "refused":
            for reason in r.refusal:
                c[(r.backend, normalise(reason, 140))] += 1
    return c


def summary(results: list[Result], *, seed: int, seconds: float, processes: int = 1, title: str = "qkv fuzz") -> str:
    """The long run's report."""
    by_status = collections.Counter(r.status for r in results)
    lines = [
        f"{title}: base seed {seed}, {len(results)} calls in {seconds:.0f} s on {processes} process(es)",
        f"  ok {by_status['ok']}, refused {by_status['refused']}, failed {by_status['failed']} "
        f"(set {SEED_ENV}={seed} to draw the same calls)",
        "",
        "calls by backend:",
    ]
    per_backend: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in results:
        per_backend[r.backend][r.status] += 1
    for b, c in sorted(per_backend.items()):
        lines.append(f"  {b:8s} {sum(c.values()):6d} calls  ok {c['ok']:6d}  refused {c['refused']:5d}  failed {c['failed']:5d}")
    ref = refusals(results)
    lines += ["", f"refusals (qkv.BackendError from a named backend, by reason): {sum(ref.values())} reasons given"]
    for (b, reason), n in sorted(ref.items(), key=lambda kv: (kv[0][0], -kv[1])):
        lines.append(f"  {b:8s} {n:6d}  {reason}")
    groups = group_failures(results)
    lines += ["", f"failures: {by_status['failed']} calls, {len(groups)} groups (check [backend]: calls)"]
    for i, g in enumerate(groups, 1):
        r = g.smallest
        detail = g.details[g.cases.index(r)]
        lines.append(f"  {i:2d}. {g.kind} [{g.backend}]: {len(g.cases)}")
        if detail:
            lines.append(f"      e.g. {detail}")
        tags = common_tags(g, results)
        if tags:
            lines.append(f"      all have: {', '.join(tags)}")
        lines.append(f"      smallest: {r.describe}")
        lines.append(f"      reproduce: {r.repro}")
    return "\n".join(lines)


def failure_message(results: list[Result], seed: int, limit: int = 8) -> str:
    """What a failing pytest chunk prints: the seed, the groups, the first failures in full."""
    failed = [r for r in results if r.status == "failed"]
    lines = [
        f"{len(failed)} of {len(results)} fuzz calls failed (base seed {seed}; rerun with {SEED_ENV}={seed})",
    ]
    for g in group_failures(failed):
        r = g.smallest
        lines.append(f"  {len(g.cases):4d} × {g.kind} [{g.backend}] — smallest: {r.repro}")
    lines.append("")
    lines += [r.message() for r in failed[:limit]]
    if len(failed) > limit:
        lines.append(f"... and {len(failed) - limit} more")
    return "\n".join(lines)
