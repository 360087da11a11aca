"""How much of the machine other processes took while we measured, and waiting for it to calm.

On a small shared machine (2 cores here, other people's test suites running) a benchmark cell is
only meaningful next to the CPU that others used during it. Linux ``/proc`` gives both numbers:
the whole machine's busy time, and the CPU time of our own processes (this one and the server).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "CpuMeter",
    "Quiet",
    "busy_share",
    "describe_machine",
    "machine_busy_s",
    "machine_name",
    "process_cpu_s",
    "threads_cpu_s",
    "tree_cpu_s",
    "wait_until_quiet",
]

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_CPUS = os.cpu_count() or 1


def _machine_busy_s() -> float:
    """Seconds of CPU the whole machine spent busy since boot (all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / _TICKS_PER_S


def machine_busy_s() -> float:
    """Seconds of CPU the whole machine spent busy since boot (all cores), for callers that
    sample it themselves."""
    return _machine_busy_s()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` (every thread); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0.0
    # Field 2 (comm) may hold spaces; everything after its closing parenthesis is fixed.
    rest = stat[stat.rindex(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / _TICKS_PER_S


def threads_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s live threads, to the nanosecond (the scheduler's own account,
    ``/proc/PID/task/*/schedstat``), where :func:`process_cpu_s` counts 10 ms clock ticks: one
    run of a few hundred tokens is only a few ticks. A thread that has exited no longer counts
    (a server's threads live as long as it does); 0 once the process is gone."""
    total_ns = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total_ns += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total_ns / 1e9


def _with_descendants(pids: Iterable[int]) -> list[int]:
    """``pids`` and all their children, grandchildren... (quicsrv's engine worker process)."""
    found: list[int] = []
    pending = list(pids)
    while pending:
        pid = pending.pop()
        found.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    pending.extend(int(child) for child in f.read().split())
            except OSError:
                continue
    return found


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (a process that has
    exited no longer counts: sample a tree whose members live through the interval)."""
    return sum(process_cpu_s(member) for member in _with_descendants([pid]))


class CpuMeter:
    """CPU time used by processes other than ``ours`` (and their descendants) between
    construction and :meth:`stop`."""

    def __init__(self, ours: Iterable[int]) -> None:
        self._ours = _with_descendants(ours)
        self._started = time.perf_counter()
        self._machine = _machine_busy_s()
        self._own = sum(process_cpu_s(pid) for pid in self._ours)

    def stop(self) -> float:
        """Others' share of the machine over the interval: 0.0 idle, 1.0 every core busy."""
        wall = time.perf_counter() - self._started
        machine = _machine_busy_s() - self._machine
        own = sum(process_cpu_s(pid) for pid in self._ours) - self._own
        return max(0.0, machine - own) / (wall * _CPUS) if wall > 0 else 0.0


def busy_share(window_s: float) -> float:
    """The machine's busy share over the next ``window_s`` seconds (all processes)."""
    meter = CpuMeter(())
    time.sleep(window_s)  # a measurement window, not synchronisation
    return meter.stop()


def wait_until_quiet(threshold: float, patience_s: float, window_s: float = 2.0) -> float:
    """Sample the machine until it is busier than ``threshold`` no more, for ``patience_s``.

    Returns the last sample. Called while our own processes are idle, so what it sees is others.
    Bounded: after ``patience_s`` it gives up and the cell runs anyway (and says so in its row).
    """
    deadline = time.monotonic() + patience_s
    share = busy_share(window_s)
    while share > threshold and time.monotonic() < deadline:
        share = busy_share(window_s)
    return share


@dataclass(frozen=True, slots=True)
class Quiet:
    """``wait_until_quiet`` with its settings, as a value another process can be handed."""

    below: float
    patience_s: float

    def __call__(self) -> float:
        """Wait (bounded) until other processes leave the machine; their last busy share."""
        if self.patience_s <= 0:
            return 0.0
        return wait_until_quiet(self.below, self.patience_s)


def describe_machine(cpuinfo: str, meminfo: str, usable_cpus: int) -> str:
    """One line naming a machine from its ``/proc/cpuinfo`` and ``/proc/meminfo`` text: the
    CPU model, the matrix units llama.cpp may use (AMX, AVX-512), the CPUs this process may run
    on and of how many, the memory. A virtual CPU often calls itself only "Intel(R) Xeon(R)
    Processor", so the flags say more than the name."""
    model = "unknown CPU"
    flags: set[str] = set()
    logical = 0
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            logical += 1
        elif key == "model name" and model == "unknown CPU":
            model = " ".join(value.split())
        elif key == "flags" and not flags:
            flags = set(value.split())
    units = [
        name
        for name, flag in (("AMX", "amx_tile"), ("AVX-512", "avx512f"), ("AVX2", "avx2"))
        if flag in flags
    ]
    memory = ""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            memory = f", {int(line.split()[1]) / 2**20:.1f} GiB"
            break
    with_units = f" with {'/'.join(units)}" if units else ""
    return f"{model}{with_units}, {usable_cpus} of {logical or usable_cpus} CPUs usable{memory}"


def machine_name() -> str:
    """:func:`describe_machine` of this machine (the CPUs this process may run on)."""
    with open("/proc/cpuinfo") as f:
        cpuinfo = f.read()
    try:
        with open("/proc/meminfo") as f:
            meminfo = f.read()
    except OSError:
        meminfo = ""
    return describe_machine(cpuinfo, meminfo, len(os.sched_getaffinity(0)))
