"""``make demo`` / ``make demo-resume``: start a server, run the client against it, stop.

``python -m quicsrv.demo`` streams one generation through ``quicsrv-client generate``;
``python -m quicsrv.demo resume`` runs ``quicsrv-client demo-resume`` (cut, resume, compare).
The server is started on an ephemeral port and its "listening" line tells us which; no sleeps.
The client runs as its own process, as a user would run it: the server package never imports
the client's.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from .spawn import ServerDidNotStart, spawn_server

PROMPT = "Explain in two sentences why the sky is blue."


def main(argv: list[str] | None = None) -> int:
    mode = (argv if argv is not None else sys.argv[1:])[:1]
    data_dir = Path(tempfile.mkdtemp(prefix="quicsrv-demo-"))
    # The server's log goes to a file: nothing it says lands in the middle of the generated text.
    log = data_dir / "server.log"
    serve = ["--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir)]
    print("starting quicsrv serve (loading the model) ...", flush=True)
    try:
        with spawn_server(serve, log=log) as server:
            where = ["--host", "127.0.0.1", "--port", str(server.port)]
            if mode == ["resume"]:
                print("\n$ quicsrv-client demo-resume\n", flush=True)
                arguments = ["demo-resume", *where]
            else:
                print(
                    f"\n$ quicsrv-client generate {PROMPT!r} --chat --max-tokens 96\n", flush=True
                )
                arguments = ["generate", PROMPT, "--chat", *where, "--max-tokens", "96"]
            client = [sys.executable, "-m", "quicsrv_client.cli", *arguments]
            status = subprocess.run(client).returncode
    except ServerDidNotStart as exc:
        print(f"demo: {exc}\nthe server's log: {log}", file=sys.stderr)
        return 1
    print(f"\nthe server's log: {log}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
