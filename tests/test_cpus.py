"""How many CPUs the process may use, and the engine's default thread count made of it (no model,
no sockets: the cgroup files are given)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from quicsrv.config import ConfigError, ServerConfig
from quicsrv.cpus import CpuBudget, cgroup_quota, parse_cpu_max, usable_cpus
from quicsrv.settings import engine_settings, engine_threads
from quicsrv.workers import worker_configs


def _files(files: dict[str, str]):
    return lambda path: files.get(str(path))


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("max 100000", None),
        ("150000 100000", 1.5),
        ("400000 100000\n", 4.0),
        ("", None),
        ("200000", 2.0),
        ("junk 100000", None),
        ("0 100000", None),
    ],
)
def test_cpu_max_is_read_in_cpus(text, cpus):
    assert parse_cpu_max(text) == cpus


def test_a_v2_quota_on_the_group_or_above_it_counts_the_tightest():
    read = _files(
        {
            "/proc/self/cgroup": "0::/system.slice/quicsrv.service\n",
            "/sys/fs/cgroup/system.slice/quicsrv.service/cpu.max": "300000 100000\n",
            "/sys/fs/cgroup/system.slice/cpu.max": "200000 100000\n",
            "/sys/fs/cgroup/cpu.max": "max 100000\n",
        }
    )
    assert cgroup_quota(read) == 2.0


def test_a_v1_cfs_quota_counts_and_minus_one_is_none():
    groups = "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n0::/\n"
    quota = _files(
        {
            "/proc/self/cgroup": groups,
            "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000\n",
            "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        }
    )
    assert cgroup_quota(quota) == 0.5
    none = _files(
        {
            "/proc/self/cgroup": groups,
            "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "-1\n",
            "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        }
    )
    assert cgroup_quota(none) is None
    assert cgroup_quota(_files({})) is None


@pytest.mark.parametrize(
    ("affinity", "quota", "count"),
    [(16, None, 16), (16, 4.0, 4), (16, 2.5, 2), (16, 0.5, 1), (2, 8.0, 2), (0, None, 1)],
)
def test_the_budget_is_the_affinity_cut_by_the_quota_in_whole_cpus(affinity, quota, count):
    assert CpuBudget(affinity=affinity, quota=quota).count == count


def test_this_process_budget_is_within_its_affinity():
    budget = usable_cpus()
    assert 1 <= budget.count <= len(os.sched_getaffinity(0))
    assert str(budget.count) in budget.describe()


def test_the_default_thread_count_is_every_usable_cpu_split_across_the_workers():
    sixteen = CpuBudget(affinity=16, quota=None)
    assert engine_threads(ServerConfig(), sixteen) == 16
    assert engine_threads(ServerConfig(workers=4), sixteen) == 4
    assert engine_threads(ServerConfig(workers=32), sixteen) == 1
    assert engine_threads(ServerConfig(n_threads=3), sixteen) == 3  # given: as given
    assert engine_threads(ServerConfig(), CpuBudget(affinity=16, quota=6.0)) == 6
    # What the engine is built with, on this machine.
    settings = engine_settings(ServerConfig(), Path("model.gguf"))
    assert settings.n_threads == usable_cpus().count


def test_each_worker_gets_its_share_or_at_most_the_given_count():
    usable = usable_cpus().count
    shares = [c.n_threads for c in worker_configs(ServerConfig(workers=2), 4433)]
    assert shares == [max(1, usable // 2)] * 2
    capped = [c.n_threads for c in worker_configs(ServerConfig(workers=2, n_threads=64), 4433)]
    assert capped == [max(1, usable // 2)] * 2


def test_a_negative_thread_count_is_refused_by_name():
    with pytest.raises(ConfigError, match="n_threads"):
        ServerConfig(n_threads=-1).check()
