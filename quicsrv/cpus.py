"""How many CPUs this process may use: the engine's default thread count comes from here.

``os.cpu_count()`` counts the machine's CPUs, not this process's: a CPU affinity mask
(``taskset``, a cpuset) and a CPU quota (a container's ``--cpus``: the cgroup's ``cpu.max`` in
cgroup v2, ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1, on its own group or any above it)
both give it fewer. Threads past that number only wait for each other: llama.cpp's threads meet
at a barrier after every operation, so one that is descheduled stalls the whole decode.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["CpuBudget", "cgroup_quota", "parse_cpu_max", "usable_cpus"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class CpuBudget:
    """The CPUs this process may use, and why."""

    affinity: int
    """CPUs in its affinity mask."""
    quota: float | None
    """CPUs' worth of time its cgroup quota allows (None: no quota)."""

    @property
    def count(self) -> int:
        """Whole CPUs it may keep busy: the affinity mask, cut by the quota (rounded down, at
        least 1: a quota of 1.5 CPUs runs 1 thread without throttling, 2 would be throttled)."""
        if self.quota is None:
            return max(1, self.affinity)
        return max(1, min(self.affinity, math.floor(self.quota)))

    def describe(self) -> str:
        quota = "no cgroup CPU quota" if self.quota is None else f"cgroup quota {self.quota:g}"
        cpus = f"{self.count} usable CPU{'s' if self.count != 1 else ''}"
        return f"{cpus} (affinity {self.affinity}, {quota})"


def usable_cpus(read: Callable[[Path], str | None] | None = None) -> CpuBudget:
    """This process's :class:`CpuBudget` (``read``: how files are read, for tests)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        affinity = os.cpu_count() or 1
    return CpuBudget(affinity=affinity, quota=cgroup_quota(read or _read))


def cgroup_quota(read: Callable[[Path], str | None]) -> float | None:
    """The tightest CPU quota on this process's cgroup or any group above it, in CPUs (None:
    none). Reads ``/proc/self/cgroup`` and the quota files through ``read``."""
    groups = read(Path("/proc/self/cgroup"))
    if groups is None:
        return None
    quotas: list[float] = []
    for line in groups.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not PurePosixPath(path).is_absolute():
            continue
        if hierarchy == "0" and controllers == "":  # cgroup v2: the unified hierarchy
            for group in _self_and_ancestors(_CGROUP_ROOT, path):
                quota = parse_cpu_max(read(group / "cpu.max"))
                if quota is not None:
                    quotas.append(quota)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's hierarchy
            mount = _CGROUP_ROOT / controllers
            for group in _self_and_ancestors(mount, path):
                quota = _parse_cfs(
                    read(group / "cpu.cfs_quota_us"), read(group / "cpu.cfs_period_us")
                )
                if quota is not None:
                    quotas.append(quota)
    return min(quotas) if quotas else None


def parse_cpu_max(text: str | None) -> float | None:
    """cgroup v2's ``cpu.max`` (``"$MAX $PERIOD"``, ``max`` for none) in CPUs."""
    if not text:
        return None
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _parse_cfs(quota_text: str | None, period_text: str | None) -> float | None:
    """cgroup v1's quota and period in microseconds (a quota of -1: none) in CPUs."""
    try:
        quota = int((quota_text or "").strip())
        period = int((period_text or "").strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _self_and_ancestors(root: Path, path: str) -> list[Path]:
    parts = [p for p in path.split("/") if p]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
