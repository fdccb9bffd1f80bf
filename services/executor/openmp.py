"""How the executor's OpenMP threads wait for each other. libgomp reads the setting once, when torch
loads it, so a program applies `default_wait` to os.environ before `import torch`; this module imports
nothing heavy.

OpenMP threads spin a little, then sleep, unless the operator chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT).
A CPU executor shares its cores with the stack's other processes, and a step has hundreds of barriers.
libgomp's default (~300,000 spin rounds) holds a thread spinning while its descheduled partner waits for a
core: 16 streams' step 131 ms (max 354) beside two busy processes. Sleeping at once
(OMP_WAIT_POLICY=PASSIVE) pays a wake-up at every barrier: one stream's step 13.6-15.2 ms against 9.9 on a
quiet machine. 1,000 rounds keep most of both: 9.9 ms quiet, 103-104 (max 121-125) beside the busy
processes (PASSIVE 107-117, max 143-144); 10,000 had longer tails there and in the full stack
(docs/benchmarks.md, "OpenMP threads that spin a little").

The executor service (`python -m l4m.executor`) sets it, and so does every benchmark that times the
executor's engine as the service runs it, so that "the executor alone" and the executor in the stack wait
alike (docs/benchmarks.md, round 11).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

SPIN_COUNT = 1000
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what libgomp reads; either one is the operator's choice


def default_wait(environ: Mapping[str, str]) -> dict[str, str]:
    """What to add to `environ`: GOMP_SPINCOUNT = `SPIN_COUNT`, unless OMP_WAIT_POLICY or GOMP_SPINCOUNT is
    there (the operator chose). `os.environ.update(default_wait(os.environ))` applies it."""
    if any(name in environ for name in WAIT_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def describe_wait(environ: Mapping[str, str] = os.environ) -> str:
    """The OpenMP wait `environ` asks libgomp for, as a benchmark's notes record it."""
    settings = [f"{name}={environ[name]}" for name in WAIT_VARIABLES if name in environ]
    return ", ".join(settings) or "libgomp's default"
