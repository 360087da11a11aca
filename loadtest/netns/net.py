"""Two network namespaces joined by a veth pair, with a delay on each end; always torn down.

The addresses live on the pair only, inside namespaces created here (nothing is routed
anywhere else). The delay comes from ``tc qdisc ... netem`` when the kernel has it; a kernel
built without ``CONFIG_NET_SCH_NETEM`` answers "Specified qdisc kind is unknown", and then the
caller may fall back to the user-space delay line in :mod:`loadtest.netns.link`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

__all__ = ["NetemUnavailable", "Netns", "ip_run"]

SERVER_ADDRESS = "10.200.0.1"
CLIENT_ADDRESS = "10.200.0.2"
PREFIX_LEN = 30


class NetemUnavailable(RuntimeError):
    """``tc`` could not add a netem qdisc; the message is what tc said."""


def ip_run(*args: str) -> str:
    """Run ``ip``/``tc`` (args[0]) and return stdout; raise with its stderr on failure."""
    done = subprocess.run(list(args), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass
class Netns:
    """A server namespace and a client namespace, ``SERVER_ADDRESS`` <-> ``CLIENT_ADDRESS``."""

    tag: str = field(default_factory=lambda: str(os.getpid()))
    server_ns: str = ""
    client_ns: str = ""
    server_if: str = ""
    client_if: str = ""
    created: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.server_ns = self.server_ns or f"qs-srv-{self.tag}"
        self.client_ns = self.client_ns or f"qs-cli-{self.tag}"
        # Interface names: at most 15 bytes (IFNAMSIZ - 1).
        self.server_if = self.server_if or f"qss{self.tag}"[:15]
        self.client_if = self.client_if or f"qsc{self.tag}"[:15]

    @staticmethod
    def check_tools() -> None:
        """Fail early, with the reason, when this cannot work at all."""
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root: run this as root")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"`{tool}` (iproute2) is not installed")

    def create(self) -> None:
        """Create both namespaces and the veth pair, addresses up, loopback up."""
        for ns in (self.server_ns, self.client_ns):
            ip_run("ip", "netns", "add", ns)
            self.created.append(ns)
            ip_run("ip", "-n", ns, "link", "set", "lo", "up")
        # Create the pair inside the server namespace directly: it never appears in the
        # namespace this script was started from.
        ip_run(
            "ip", "-n", self.server_ns, "link", "add", self.server_if,
            "type", "veth", "peer", "name", self.client_if, "netns", self.client_ns,
        )  # fmt: skip
        for ns, dev, address in (
            (self.server_ns, self.server_if, SERVER_ADDRESS),
            (self.client_ns, self.client_if, CLIENT_ADDRESS),
        ):
            ip_run("ip", "-n", ns, "addr", "add", f"{address}/{PREFIX_LEN}", "dev", dev)
            ip_run("ip", "-n", ns, "link", "set", dev, "up")

    def add_netem(self, delay_ms: float) -> None:
        """``netem delay`` on both ends (so ``delay_ms`` each way); NetemUnavailable if not."""
        for ns, dev in ((self.server_ns, self.server_if), (self.client_ns, self.client_if)):
            try:
                ip_run(
                    "tc", "-n", ns, "qdisc", "add", "dev", dev, "root",
                    "netem", "delay", f"{delay_ms}ms",
                )  # fmt: skip
            except RuntimeError as exc:
                raise NetemUnavailable(str(exc)) from None

    def qdiscs(self) -> str:
        """``tc qdisc show`` of both ends (for the report)."""
        return "".join(
            ip_run("tc", "-n", ns, "qdisc", "show", "dev", dev)
            for ns, dev in ((self.server_ns, self.server_if), (self.client_ns, self.client_if))
        )

    def exec_prefix(self, ns: str) -> list[str]:
        """The command prefix that runs a program inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns]

    def destroy(self) -> list[str]:
        """Kill what still runs inside our namespaces, then delete them; return any errors."""
        errors: list[str] = []
        for ns in reversed(self.created):
            pids = subprocess.run(
                ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
            ).stdout.split()
            for pid in pids:  # only processes inside a namespace this object created
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            if pids:
                time.sleep(0.2)  # let the kernel reap them before the namespace goes
            try:
                ip_run("ip", "netns", "del", ns)  # deleting a namespace deletes its veth end
            except RuntimeError as exc:
                errors.append(str(exc))
        self.created.clear()
        return errors

    def __enter__(self) -> Netns:
        self.check_tools()
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for error in self.destroy():
            print(f"netns teardown: {error}", flush=True)
