"""0-RTT resume on a link with real delay: two network namespaces, a veth pair, a delay.

Creates ``qs-srv-<pid>`` and ``qs-cli-<pid>`` joined by a veth pair (10.200.0.1/30 and
10.200.0.2/30, on the pair only), delays every packet ``--delay-ms`` each way, runs
``quicsrv serve`` in the server namespace and the measurements (:mod:`loadtest.netns.client`)
in the client namespace, then tears everything down, also on Ctrl-C or SIGTERM.

Medians over ``--runs`` of: the handshake of a fresh connection; reconnect to the first resumed
token with 0-RTT, and with a full handshake; a fresh generation to the same token index. Round
trips saved = (full handshake - 0-RTT) / RTT, with RTT = 2 x delay.

The delay comes from ``tc netem`` when the kernel has it. ``--shaper auto`` (default) falls back
to a user-space delaying UDP relay in the server namespace (:mod:`loadtest.netns.link`) when
netem is missing, and says so in the report; ``--shaper netem`` refuses to fall back.

Run (as root): ``.venv/bin/python -m loadtest.netns [--runs 10] [--delay-ms 25]``
Writes ``loadtest/results/netns-<time>.{md,json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

from loadtest.netns.certs import issue_certs
from loadtest.netns.net import SERVER_ADDRESS, NetemUnavailable, Netns
from quicsrv.spawn import spawn_server

SERVER_PORT = 4433
RELAY_PORT = 4434
ECHO_PORT = 4499
ROWS = (
    ("handshake", "handshake, fresh connection (no ticket)"),
    ("resume_0rtt", "reconnect → first resumed token, 0-RTT"),
    ("resume_full", "reconnect → first resumed token, full handshake"),
    ("fresh", "fresh generation → same token index (connect + GENERATE)"),
    ("fresh_first_token", "fresh generation → its first token"),
)


def _python() -> str:
    return sys.executable


def _raise_interrupt(signum: int, _frame: object) -> NoReturn:
    raise KeyboardInterrupt(f"signal {signum}")


def _wait_for_line(
    process: subprocess.Popen[bytes], log: Path, needle: str, timeout_s: float
) -> None:
    """Wait until ``needle`` appears in ``log`` (the process's output), or fail with its tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        if needle in text:
            return
        if process.poll() is not None:
            raise RuntimeError(f"{log.stem} process exited ({process.returncode}):\n{text[-3000:]}")
        time.sleep(0.1)  # polling a log file: no event to wait on
    raise TimeoutError(f"no {needle!r} in {log} within {timeout_s}s")


@contextlib.contextmanager
def _process(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``command`` with its output in ``log``; SIGTERM (then SIGKILL) it on leaving."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Set up the link, run server and client, return the client's JSON plus the set-up."""
    certs = issue_certs(work / "certs", SERVER_ADDRESS)
    setup: dict[str, Any] = {"delay_ms_each_way": args.delay_ms, "runs": args.runs}
    with Netns() as net:
        setup["namespaces"] = [net.server_ns, net.client_ns]
        shaper = args.shaper
        if shaper in ("auto", "netem"):
            try:
                net.add_netem(args.delay_ms)
                shaper = "netem"
            except NetemUnavailable as exc:
                setup["netem_error"] = str(exc)
                if shaper == "netem":
                    raise
                print(f"netem unavailable: {exc}\nfalling back to the user-space relay", flush=True)
                shaper = "relay"
        setup["shaper"] = shaper
        setup["qdiscs"] = net.qdiscs()
        link = [
            *net.exec_prefix(net.server_ns), _python(), "-m", "loadtest.netns.link",
            "--host", SERVER_ADDRESS, "--echo-port", str(ECHO_PORT),
        ]  # fmt: skip
        port = SERVER_PORT
        if shaper == "relay":
            link += ["--relay-port", str(RELAY_PORT), "--target", f"{SERVER_ADDRESS}:{SERVER_PORT}"]
            link += ["--delay-ms", str(args.delay_ms)]
            port = RELAY_PORT
        serve = [
            "--host", SERVER_ADDRESS, "--port", str(SERVER_PORT),
            "--data-dir", str(work / "data"), "--threads", str(args.server_threads),
            "--cert", str(certs.server_cert), "--key", str(certs.server_key),
        ]  # fmt: skip
        measure = [
            *net.exec_prefix(net.client_ns), _python(), "-m", "loadtest.netns.client",
            "--host", SERVER_ADDRESS, "--port", str(port), "--ca", str(certs.ca_cert),
            "--echo-port", str(ECHO_PORT), "--runs", str(args.runs),
            "--cut-index", str(args.cut_index), "--max-tokens", str(args.max_tokens),
        ]  # fmt: skip
        with (
            _process(link, work / "link.log") as link_process,
            spawn_server(serve, prefix=net.exec_prefix(net.server_ns), log=work / "server.log"),
        ):
            _wait_for_line(link_process, work / "link.log", "ready", 30)
            print(f"server up in {net.server_ns}, measuring from {net.client_ns}", flush=True)
            done = subprocess.run(measure, stdout=subprocess.PIPE, check=False)
            if done.returncode != 0:
                log = (work / "server.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"client exited {done.returncode}; server log tail:\n{log}")
        result: dict[str, Any] = json.loads(done.stdout)
    result["setup"] = setup
    return result


def _ms(values: list[float]) -> list[float]:
    return [v * 1000 for v in values if not math.isnan(v)]


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians (ms) per measurement and the round trips saved."""
    setup = result["setup"]
    rtt_ms = 2 * setup["delay_ms_each_way"]
    probe_ms = result["probe_rtt_median_ms"]
    medians = {kind: statistics.median(_ms(values)) for kind, values in result["samples_s"].items()}
    saved_ms = medians["resume_full"] - medians["resume_0rtt"]
    # Run i's two resumes ran back to back: their difference cancels slow phases of the machine.
    paired = [
        (full - early) * 1000
        for full, early in zip(
            result["samples_s"]["resume_full"], result["samples_s"]["resume_0rtt"], strict=True
        )
    ]
    paired_ms = statistics.median(paired)
    resumes = result["resumes"]
    return {
        "rtt_nominal_ms": rtt_ms,
        "rtt_probe_median_ms": probe_ms,
        "medians_ms": medians,
        "saved_ms": saved_ms,
        "saved_paired_median_ms": paired_ms,
        "round_trips_saved": saved_ms / rtt_ms if rtt_ms else None,
        "round_trips_saved_paired": paired_ms / rtt_ms if rtt_ms else None,
        "round_trips_saved_probe_rtt": saved_ms / probe_ms if rtt_ms else None,
        "early_data_0rtt": sum(bool(r["early_data"]) for r in resumes["resume_0rtt"]),
        "early_data_full": sum(bool(r["early_data"]) for r in resumes["resume_full"]),
        "resumes_in_order": sum(
            r["first_index"] == result["cut_index"] + 1 for kind in resumes.values() for r in kind
        ),
        "resume_paths": sorted({str(r["resume_path"]) for kind in resumes.values() for r in kind}),
    }


def table(result: dict[str, Any], summary: dict[str, Any]) -> str:
    """The report in markdown."""
    setup = result["setup"]
    rtt, probe = summary["rtt_nominal_ms"], summary["rtt_probe_median_ms"]
    runs = setup["runs"]
    shaper = {
        "netem": "`tc netem delay` on both veth ends",
        "relay": "user-space delaying UDP relay (netem unavailable: "
        f"{setup.get('netem_error', '?')})",
        "none": "none (no delay added)",
    }[setup["shaper"]]
    lines = [
        f"Delay {setup['delay_ms_each_way']:g} ms each way ({shaper}); nominal RTT {rtt:g} ms, "
        f"measured UDP probe RTT {probe:.1f} ms (median). {runs} runs; cut after token "
        f"{result['cut_index']}, so every resume and the fresh generation stop at token "
        f"{result['cut_index'] + 1}.",
        "",
        "| measurement | median | min | max | median / RTT |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind, label in ROWS:
        values = _ms(result["samples_s"][kind])
        median = summary["medians_ms"][kind]
        lines.append(
            f"| {label} | {median:.1f} ms | {min(values):.1f} ms | {max(values):.1f} ms | "
            f"{median / rtt:.2f} |"
            if rtt
            else f"| {label} | {median:.1f} ms | {min(values):.1f} ms | {max(values):.1f} ms | - |"
        )
    saved = summary["round_trips_saved"]
    saving = (
        f"0-RTT saves {summary['saved_ms']:.1f} ms per resume (difference of the medians; "
        f"median of the per-run differences: {summary['saved_paired_median_ms']:.1f} ms)"
    )
    if saved is not None:
        saving += (
            f" = **{saved:.2f} round trips** at the nominal RTT "
            f"({summary['round_trips_saved_paired']:.2f} paired; "
            f"{summary['round_trips_saved_probe_rtt']:.2f} at the measured probe RTT)."
        )
    else:
        saving += "; no delay was added, so this is processing time, not round trips."
    lines += [
        "",
        saving,
        f"Server answered from early data: {summary['early_data_0rtt']}/{runs} 0-RTT resumes, "
        f"{summary['early_data_full']}/{runs} full-handshake resumes. "
        f"Resume paths: {', '.join(summary['resume_paths'])}; "
        f"{summary['resumes_in_order']}/{2 * runs} resumes began at token "
        f"{result['cut_index'] + 1}.",
    ]
    if result.get("missing_tickets"):
        lines.append(f"No ticket in the cache before {result['missing_tickets']} 0-RTT resumes.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.netns", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--delay-ms", type=float, default=25.0, help="added delay, each way")
    parser.add_argument("--shaper", choices=("auto", "netem", "relay", "none"), default="auto")
    parser.add_argument("--cut-index", type=int, default=9, help="last token before the cut")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--server-threads",
        type=int,
        default=1,
        help="llama.cpp threads (1 leaves a core to the client and relay on small machines)",
    )
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        parser.exit(2, "netns_bench: needs root (network namespaces, veth, tc)\n")
    if args.shaper == "none":
        args.delay_ms = 0.0
    # Whatever stops us, the finally blocks tear the namespaces down (SIGINT too, even when
    # started from a shell that ignores it in background jobs).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGHUP, _raise_interrupt)
    with tempfile.TemporaryDirectory(prefix="qs-netns-") as work:
        try:
            result = run(args, Path(work))
        except KeyboardInterrupt:
            print("interrupted: namespaces and server torn down", file=sys.stderr)
            raise SystemExit(130) from None
        except NetemUnavailable as exc:
            parser.exit(1, f"netns_bench: netem unavailable ({exc}); try --shaper relay\n")
    summary = summarize(result)
    result["summary"] = summary
    report = table(result, summary)
    print(report)
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"netns-{stamp}.md").write_text(report + "\n")
    (args.out / f"netns-{stamp}.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.out}/netns-{stamp}.{{md,json}}")


if __name__ == "__main__":
    main()
