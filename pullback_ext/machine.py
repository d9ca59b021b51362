"""The machine a timed run measures on: how many cores this process may use, and whether other
processes keep them busy (a wall-clock time measured then is slower than on an idle machine)."""

from __future__ import annotations

import os
from typing import Optional


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the platform tells, else all)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def busy_note(what: str, cores: Optional[int] = None) -> Optional[str]:
    """One line saying that the 1-minute load average exceeds ``cores`` (default
    :func:`usable_cores`), so ``what`` (e.g. "wall-clock times") measured now is slowed by other
    processes; None when the machine is not that busy or reports no load average."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform
        return None
    cores = usable_cores() if cores is None else cores
    if load <= cores:
        return None
    return (f"the machine is busy (1-minute load average {load:.1f} on {cores} cores): {what} measured now "
            "are slower than on an idle machine")
