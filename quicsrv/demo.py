"""``make demo`` / ``make demo-resume``: start a server, run the client against it, stop.

``python -m quicsrv.demo`` streams one generation through ``quicsrv-client generate``;
``python -m quicsrv.demo resume`` runs ``quicsrv-client demo-resume`` (cut, resume, compare).
The server is started on an ephemeral port and its "listening" line tells us which; no sleeps.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile

PROMPT = "Explain in two sentences why the sky is blue."


def main(argv: list[str] | None = None) -> int:
    mode = (argv if argv is not None else sys.argv[1:])[:1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    data_dir = tempfile.mkdtemp(prefix="quicsrv-demo-")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "quicsrv.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--data-dir",
            data_dir,
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert server.stdout is not None
    try:
        port = None
        for line in server.stdout:
            print(line, end="", flush=True)
            match = re.search(r"listening on \S+:(\d+)", line)
            if match:
                port = match.group(1)
                break
        if port is None:
            print("demo: the server exited before listening", file=sys.stderr)
            return 1
        from client.cli import main as client_main

        if mode == ["resume"]:
            print("\n$ quicsrv-client demo-resume\n", flush=True)
            return client_main(["demo-resume", "--host", "127.0.0.1", "--port", port])
        print(f"\n$ quicsrv-client generate {PROMPT!r} --chat --max-tokens 96\n", flush=True)

        return client_main(
            [
                "generate",
                PROMPT,
                "--chat",
                "--host",
                "127.0.0.1",
                "--port",
                port,
                "--max-tokens",
                "96",
            ]
        )
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
