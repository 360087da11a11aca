"""A bounded Locust run against a fresh quicsrv, with a verdict (``-m loadtest.locust.smoke``).

Starts ``quicsrv serve`` on 127.0.0.1 with an ephemeral port, a temporary data directory and
freshly made dev certificates; runs ``locust --headless`` against it (a subprocess, so gevent's
monkey-patching never reaches this process or pytest); samples the server's RSS meanwhile;
stops the server with SIGINT; then reads Locust's CSV and the locustfile's JSON tally and exits
non-zero on any lost, duplicated or reordered token, any unexpected error, a bad request that
got the wrong code, a scenario that never ran, or a server that died or did not stop cleanly.

The same harness makes the soak figures (longer ``--run-time``, more ``--users``, server flags
through ``--server-arg``) and the paused-session census (``--locustfile
loadtest/locust/parked.py --no-require-scenarios``). Everything lands in ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.locust.metrics_scrape import MetricsScraper, write_png
from quicsrv.devcerts import ensure_dev_certs
from quicsrv.spawn import ServerDidNotStart, spawn_server

__all__ = ["main"]

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 30.0
#: Locust's own start-up and shutdown, on top of ``--run-time``.
LOCUST_OVERHEAD_S = 60.0
SCENARIOS = ("plain", "slow_reader", "drop_and_resume", "bad_request")

_STORE_USAGE = re.compile(
    r"store usage: sessions (\d+) .*?, (\d+) live, kv memory (\d+) blobs ([\d.]+) MiB, "
    r"disk (\d+) blobs ([\d.]+) MiB"
)


@dataclass(slots=True)
class _RssSampler:
    """The server's resident set size, sampled on a thread."""

    pid: int
    rss_kib: list[tuple[float, int]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self, interval_s: float) -> None:
        threading.Thread(target=self._run, args=(interval_s,), daemon=True).start()

    def _run(self, interval_s: float) -> None:
        status = Path(f"/proc/{self.pid}/status")
        started = time.monotonic()
        # A periodic measurement (the wait is the sampling period), not synchronisation.
        while not self.stop.wait(interval_s):
            try:
                text = status.read_text()
            except OSError:
                return
            match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
            if match:
                self.rss_kib.append((time.monotonic() - started, int(match.group(1))))


def _server(args: argparse.Namespace, scratch: Path, out: Path) -> Any:
    """The quicsrv under test (a :func:`spawn_server` context), its output in server.log."""
    certs = ensure_dev_certs(scratch / "certs")
    (out / "ca.pem").write_bytes(certs.ca_cert.read_bytes())
    serve = [
        *("--host", "127.0.0.1", "--port", "0", "--data-dir", str(scratch / "data")),
        *("--cert", str(certs.server_cert), "--key", str(certs.server_key)),
        *args.server_arg,
    ]
    return spawn_server(
        serve,
        cwd=REPO,
        env={"QUICSRV_SESSION_SWEEP_INTERVAL_S": str(args.sweep_interval)},
        log=out / "server.log",
        start_timeout_s=STARTUP_TIMEOUT_S,
        stop_timeout_s=STOP_TIMEOUT_S,
    )


def _stop_server(process: subprocess.Popen[str]) -> int | None:
    """SIGINT (as a user's Ctrl-C), then the exit status (None if it had to be killed)."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
    try:
        return process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return None


@dataclass(frozen=True, slots=True)
class _CpuMark:
    """CPU time so far: the whole machine's busy time, the server's, and waited-for children's."""

    at_s: float
    machine_s: float
    server_s: float
    children_s: float

    @classmethod
    def take(cls, server_pid: int) -> _CpuMark:
        tick = os.sysconf("SC_CLK_TCK")
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        busy = sum(fields) - fields[3] - fields[4]  # all but idle and iowait
        try:
            stat = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()
            server = int(stat[11]) + int(stat[12])  # utime, stime
        except (OSError, IndexError):
            server = 0
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return cls(
            at_s=time.monotonic(),
            machine_s=busy / tick,
            server_s=server / tick,
            children_s=children.ru_utime + children.ru_stime,
        )


def _cpu_report(before: _CpuMark, after: _CpuMark) -> dict[str, float]:
    """Mean cores busy during the Locust run: the server, Locust, and everything else."""
    span = max(after.at_s - before.at_s, 1e-9)
    machine = (after.machine_s - before.machine_s) / span
    server = (after.server_s - before.server_s) / span
    locust = (after.children_s - before.children_s) / span  # Locust is the only child waited
    return {
        "cores": float(os.cpu_count() or 0),
        "machine_busy": round(machine, 2),
        "server": round(server, 2),
        "locust": round(locust, 2),
        "others": round(max(machine - server - locust, 0.0), 2),
    }


def _run_locust(args: argparse.Namespace, port: int, out: Path) -> int:
    argv = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(args.locustfile),
        "--headless",
        "--only-summary",
        "-u",
        str(args.users),
        "-r",
        str(args.spawn_rate),
        "-t",
        args.run_time,
        "--host",
        f"quic://127.0.0.1:{port}",
        "--csv",
        str(out / "locust"),
        "--html",
        str(out / "locust.html"),
        "--quic-ca",
        str(out / "ca.pem"),
        "--quic-summary",
        str(out / "summary.json"),
        *args.locust_arg,
    ]
    with (out / "locust.log").open("w") as log:
        try:
            done = subprocess.run(
                argv,
                cwd=REPO,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=_seconds(args.run_time) + LOCUST_OVERHEAD_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return -1
    return done.returncode


def _seconds(run_time: str) -> float:
    """Locust's ``-t`` syntax: ``90``, ``90s``, ``5m``, ``1h30m``."""
    total = 0.0
    for number, unit in re.findall(r"(\d+(?:\.\d+)?)([hms]?)", run_time):
        total += float(number) * {"h": 3600, "m": 60, "s": 1, "": 1}[unit]
    return total


def _percentiles(stats_csv: Path) -> dict[str, dict[str, Any]]:
    """Per request name: count, failures, p50, p99 (ms) from Locust's ``*_stats.csv``."""
    rows: dict[str, dict[str, Any]] = {}
    if not stats_csv.exists():
        return rows
    with stats_csv.open() as f:
        for row in csv.DictReader(f):
            rows[f"{row['Type']} {row['Name']}".strip()] = {
                "count": int(row["Request Count"]),
                "failures": int(row["Failure Count"]),
                "p50_ms": row["50%"],
                "p99_ms": row["99%"],
                "avg_ms": round(float(row["Average Response Time"] or 0), 1),
            }
    return rows


def _store_usage(log_path: Path) -> list[dict[str, float]]:
    usage = []
    for match in _STORE_USAGE.finditer(log_path.read_text(errors="replace")):
        sessions, live, blobs, mib, disk_blobs, disk_mib = match.groups()
        usage.append(
            {
                "sessions": int(sessions),
                "live": int(live),
                "kv_memory_blobs": int(blobs),
                "kv_memory_mib": float(mib),
                "kv_disk_blobs": int(disk_blobs),
                "kv_disk_mib": float(disk_mib),
            }
        )
    return usage


def _verdict(
    args: argparse.Namespace,
    locust_rc: int,
    server_rc: int | None,
    server_died: bool,
    summary: dict[str, Any] | None,
) -> list[str]:
    """Every reason the run failed (empty: it passed)."""
    problems = []
    if server_died:
        problems.append("the server exited during the run")
    if server_rc != 0:
        problems.append(f"the server did not stop cleanly on SIGINT (status {server_rc})")
    if locust_rc != 0:
        problems.append(f"locust exited with {locust_rc} (failures, or a timeout if -1)")
    if summary is None:
        problems.append("the locustfile wrote no tally")
        return problems
    for key in ("lost_tokens", "duplicated_tokens", "out_of_order_tokens", "order_failures"):
        if summary[key]:
            problems.append(f"{key}: {summary[key]}")
    if summary["unexpected_errors"]:
        problems.append(f"unexpected errors: {summary['unexpected_errors']}")
    if summary["expected_errors_wrong"]:
        problems.append(f"bad requests with the wrong answer: {summary['expected_errors_wrong']}")
    if args.require_scenarios:
        if summary["generations_checked"] == 0:
            problems.append("no generation was checked")
        missing = [s for s in SCENARIOS if not summary["scenarios"].get(s)]
        if missing:
            problems.append(f"scenarios that never ran: {missing}")
        if not summary["resume_paths"]:
            problems.append("no resume was measured")
        if not summary["expected_errors_ok"]:
            problems.append("no bad request got its code")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.locust.smoke", description=__doc__)
    parser.add_argument("-u", "--users", type=int, default=4)
    parser.add_argument("-r", "--spawn-rate", type=float, default=4.0)
    parser.add_argument("-t", "--run-time", default="30s", help="Locust -t (e.g. 30s, 5m)")
    parser.add_argument("--locustfile", type=Path, default=Path("loadtest/locust/locustfile.py"))
    parser.add_argument("--out", type=Path, help="results directory (default: a temporary one)")
    parser.add_argument(
        "--server-arg", action="append", default=[], help="extra `quicsrv serve` argument"
    )
    parser.add_argument("--locust-arg", action="append", default=[], help="extra locust argument")
    parser.add_argument("--sweep-interval", type=float, default=5.0, help="store-usage log period")
    parser.add_argument("--rss-interval", type=float, default=1.0, help="RSS sampling period")
    parser.add_argument(
        "--scrape-interval", type=float, default=1.0, help="/metrics scraping period (metrics.png)"
    )
    parser.add_argument(
        "--no-require-scenarios",
        dest="require_scenarios",
        action="store_false",
        help="do not insist that every scenario ran (for other locustfiles)",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="quicsrv-smoke-") as scratch_dir,
        contextlib.ExitStack() as stack,
    ):
        scratch = Path(scratch_dir)
        out = args.out or scratch / "out"
        out.mkdir(parents=True, exist_ok=True)
        try:
            spawned = stack.enter_context(_server(args, scratch, out))
        except ServerDidNotStart as exc:
            raise SystemExit(f"quicsrv did not start; see {out / 'server.log'}") from exc
        rss = _RssSampler(spawned.process.pid)
        rss.start(args.rss_interval)
        scraper = MetricsScraper(
            "127.0.0.1", spawned.port, ca=out / "ca.pem", interval_s=args.scrape_interval
        )
        try:
            scraper.start()
            cpu_before = _CpuMark.take(spawned.process.pid)
            locust_rc = _run_locust(args, spawned.port, out)
            cpu = _cpu_report(cpu_before, _CpuMark.take(spawned.process.pid))
            scrapes = scraper.stop()
        finally:
            rss.stop.set()
            server_died = spawned.process.poll() is not None
            server_rc = _stop_server(spawned.process)
        summary_path = out / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        usage = _store_usage(out / "server.log")
        report = {
            "users": args.users,
            "run_time": args.run_time,
            "wall_s": round(time.monotonic() - started, 1),
            "locust_rc": locust_rc,
            "server_rc": server_rc,
            "summary": summary,
            "stats": _percentiles(out / "locust_stats.csv"),
            "rss_mib": _rss_report(rss.rss_kib),
            "cpu_cores": cpu,
            "metrics": _metrics_report(scrapes, scraper.errors, out / "metrics.png"),
            "store_usage_last": usage[-1] if usage else None,
            "store_usage_max_live": max((u["live"] for u in usage), default=0),
            "store_usage_max_kv": max(
                usage, key=lambda u: u["kv_memory_blobs"] + u["kv_disk_blobs"], default=None
            ),
            "out": str(out),
        }
        problems = _verdict(args, locust_rc, server_rc, server_died, summary)
        report["problems"] = problems
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
        if problems:
            print("SMOKE FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
            print(f"--- tail of {out / 'locust.log'}", file=sys.stderr)
            print(_tail(out / "locust.log"), file=sys.stderr)
            return 1
        print(f"smoke passed in {report['wall_s']} s")
        return 0


def _metrics_report(scrapes: list[Any], errors: list[str], png: Path) -> dict[str, Any]:
    """Plot the scraped series (metrics.png) and say what the last scrape counted."""
    if len(scrapes) >= 2:
        write_png(scrapes, png, title="loadtest.locust.smoke")
    last = scrapes[-1] if scrapes else None
    return {
        "scrapes": len(scrapes),
        "errors": errors[:5],
        "png": str(png) if len(scrapes) >= 2 else None,
        "generated_tokens": last.generated_tokens if last else None,
        "max_sessions_paused": max((s.sessions_paused for s in scrapes), default=0),
    }


def _rss_report(samples: list[tuple[float, int]]) -> dict[str, Any] | None:
    """RSS in MiB: first sample, after the first tenth of the run, max, last, and per minute."""
    if not samples:
        return None
    values = [kib / 1024 for _, kib in samples]
    per_minute: dict[int, float] = {}
    for at_s, kib in samples:
        per_minute.setdefault(int(at_s // 60), round(kib / 1024, 1))
    return {
        "first": round(values[0], 1),
        "after_warmup": round(values[min(len(values) - 1, max(1, len(values) // 10))], 1),
        "max": round(max(values), 1),
        "last": round(values[-1], 1),
        "at_minute": list(per_minute.values()),
        "samples": len(values),
    }


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return "(missing)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


if __name__ == "__main__":
    sys.exit(main())
