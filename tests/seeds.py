"""Where the tests' random numbers come from: one base seed per run, one seed per test.

``QKV_TEST_SEED`` sets the base seed:

- an integer: that base seed. ``make test`` (the command CI runs) passes a fixed one, so CI
  draws the same numbers every run and never fails on a lucky or unlucky draw;
- ``fresh``, or unset (a plain ``pytest``): a new base seed each run, shared by the
  pytest-xdist workers of that run, so that local runs keep exploring new inputs.

Each test's seed is a hash of the base seed and the test's node id: a test draws the same
numbers whichever worker runs it and whatever ran before it, so a failure replays alone with
``QKV_TEST_SEED=<base> pytest '<node id>'`` (printed with every test). The fuzz test's base
seed (``tests/fuzz``), hypothesis' mode and the sanitizer sweep's seed come from here too.
"""

from __future__ import annotations

import hashlib
import os

ENV = "QKV_TEST_SEED"


def _fresh() -> int:
    # one fresh seed for the whole run: the xdist workers share the controller's run id
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id:
        return int(hashlib.sha256(run_id.encode()).hexdigest()[:8], 16)
    return int.from_bytes(os.urandom(4), "little")


def _base() -> tuple[int, bool]:
    text = os.environ.get(ENV, "").strip().lower()
    if text in ("", "fresh"):
        return _fresh(), False
    try:
        return int(text), True
    except ValueError:
        raise ValueError(f"{ENV}={text!r}: give an integer base seed, or 'fresh' for a new one each run") from None


BASE, FIXED = _base()


def derive(*parts: object) -> int:
    """A 31-bit seed from the base seed and ``parts`` (a test's node id, a name)."""
    text = "\0".join(map(str, (BASE, *parts)))
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) & 0x7FFFFFFF


def replay_hint(nodeid: str) -> str:
    return f"{ENV}={BASE} pytest '{nodeid}'"


def describe() -> str:
    how = f"fixed ({ENV}={BASE})" if FIXED else f"fresh this run ({ENV}={BASE} replays it)"
    return f"qkv test seeds: base {BASE}, {how}"


__all__ = ["BASE", "ENV", "FIXED", "derive", "describe", "replay_hint"]
