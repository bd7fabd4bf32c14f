"""Settings and helpers of the fuzz suite: bounded, deterministic (derandomize: the same cases on every run and
machine, so CI never flakes), no per-example deadline (the box is shared), no example database.

Each input surface gets at least MIN_CASES generated inputs. Hypothesis spends ~1 ms drawing one example, so
an example is expanded into a few deterministic variants of itself (prefix cuts, byte flips), each a case
that is checked on its own; every test counts the cases it ran and asserts the minimum."""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, settings

# Issue 13 asks >= 10,000 per surface; FUZZ_MIN_CASES lowers it for a quick local run (the assertion follows).
MIN_CASES = int(os.environ.get("FUZZ_MIN_CASES", "10000"))


def fuzz_settings(cases_per_example: float) -> settings:
    """Settings that reach MIN_CASES with `cases_per_example` cases per drawn example (plus 20 % headroom)."""
    return settings(max_examples=int(MIN_CASES / cases_per_example * 1.2) + 1, derandomize=True, deadline=None,
                    database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                          HealthCheck.filter_too_much,
                                                          HealthCheck.function_scoped_fixture])


def variants(data: bytes, n_cuts: int = 3, n_flips: int = 2) -> list[bytes]:
    """`data`, some of its prefixes (a writer killed mid-line) and single-bit flips, chosen from its own bytes
    (deterministic: the same input always gives the same variants)."""
    rng = random.Random(len(data) * 7919 + sum(data[:64]))
    out = [data]
    if data:
        out += [data[:rng.randrange(len(data))] for _ in range(n_cuts)]
        for _ in range(n_flips):
            b = bytearray(data)
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            out.append(bytes(b))
    return out
