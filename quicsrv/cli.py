"""``quicsrv``: ``serve`` runs the HTTP/3 server, ``certs`` makes the dev PKI, ``keys`` and
``api-key`` manage the snapshot MAC keys and the API keys.

Only ``serve`` and ``keys --store redis://`` need the ``server`` extra (llama.cpp, Redis, ...):
the other commands and every ``--help`` work with the base install. A failure is one line on
stderr and an exit status, never a traceback: 2 for usage, configuration or a missing extra,
1 for a failure while running, 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

from .config import (
    ConfigError,
    CpuExtraBuffers,
    LogFormat,
    OtelExporter,
    ResumeConflict,
    ServerConfig,
    unknown_env_vars,
)
from .devcerts import describe, ensure_dev_certs
from .logs import configure_logging
from .tracing import configure_exporter

__all__ = ["ServerExtraMissing", "main"]

log = logging.getLogger("quicsrv")

EXIT_FAILED = 1
EXIT_USAGE = 2
_OWN_PACKAGES = frozenset({"quicsrv", "quicsrv_proto", "quicsrv_client"})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quicsrv",
        description="Stream tokens from a local LLM over HTTP/3, with resumable generations; "
        "make its dev certificates, MAC keys and API keys.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the HTTP/3 server")
    serve.add_argument(
        "--config",
        type=Path,
        default=os.environ.get("QUICSRV_CONFIG") or None,
        help="TOML file with ServerConfig keys (default: $QUICSRV_CONFIG)",
    )
    serve.add_argument("--host", help="address to bind (default :: = dual-stack)")
    serve.add_argument("--port", type=int, help="UDP port (default 4433; 0 = ephemeral)")
    serve.add_argument("--model", type=Path, dest="model_path", help="any GGUF file")
    serve.add_argument(
        "--chat-template-file",
        type=Path,
        dest="chat_template_file",
        help="Jinja chat template to use instead of the GGUF's",
    )
    serve.add_argument("--cert", type=Path, dest="cert_path", help="server certificate (PEM)")
    serve.add_argument("--key", type=Path, dest="key_path", help="server private key (PEM)")
    serve.add_argument("--parallel", type=int, dest="n_seq_max", help="sequences decoded at once")
    serve.add_argument("--ctx", type=int, dest="context_per_sequence", help="tokens per sequence")
    serve.add_argument("--threads", type=int, dest="n_threads", help="llama.cpp threads")
    serve.add_argument(
        "--batch-invariant",
        action="store_const",
        const=True,
        dest="batch_invariant",
        help="decode each sequence alone so output never depends on batch composition",
    )
    serve.add_argument(
        "--no-prefix-cache",
        action="store_const",
        const=False,
        dest="prefix_cache",
        help="free a finished generation's KV cells at once instead of keeping them for the "
        "next prompt that starts the same (a chat's next turn)",
    )
    serve.add_argument(
        "--prefix-cache-shared",
        action="store_const",
        const=True,
        dest="prefix_cache_shared",
        help="let every API key reuse every key's kept KV cells (the time to first token then "
        "tells one key what another's prompts began with)",
    )
    serve.add_argument(
        "--cpu-extra-buffers",
        choices=[c.value for c in CpuExtraBuffers],
        dest="cpu_extra_buffers",
        help="llama.cpp's extra CPU weight buffers (AMX, repacking); auto: on unless the "
        "start-up canary crashes the engine worker",
    )
    serve.add_argument(
        "--worker-stall-timeout",
        type=float,
        dest="worker_stall_timeout_s",
        help="seconds without a decode step (while generating) before the worker is replaced",
    )
    serve.add_argument(
        "--token-coalesce-ms",
        type=float,
        dest="token_coalesce_ms",
        help="longest a generated token waits to leave with the next ones (0: each at once; "
        "first tokens and ends never wait)",
    )
    serve.add_argument(
        "--no-tcp",
        action="store_const",
        const=False,
        dest="tcp_listener",
        help="serve HTTP/3 only: no HTTP/1.1 + HTTP/2 listener on the same TCP port",
    )
    serve.add_argument("--model-name", dest="model_name", help="the model id /v1/models lists")
    serve.add_argument("--data-dir", type=Path, dest="data_dir", help="sessions, KV and MAC keys")
    serve.add_argument(
        "--store",
        help="where sessions, MAC keys and tickets live: file (default, under --data-dir) or "
        "redis://host:port/db (shared by every process naming it; keep that Redis private)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        help="server processes on the port (SO_REUSEPORT; N model copies); >1 needs --store redis",
    )
    serve.add_argument(
        "--kv-shared-dir",
        type=Path,
        dest="kv_shared_dir",
        help="with Redis: paused KV blobs too big for Redis go here (a path every server sees)",
    )
    serve.add_argument("--session-ttl", type=float, dest="session_ttl_s", help="seconds")
    serve.add_argument(
        "--resume-conflict",
        choices=[c.value for c in ResumeConflict],
        dest="resume_conflict",
        help="a resume of a session another stream reads: end that stream, or refuse",
    )
    serve.add_argument(
        "--inexact-reprefill",
        action="store_const",
        const=True,
        dest="inexact_reprefill",
        help="rebuild lost KV by one chunked prefill: faster, output may differ after a resume",
    )
    serve.add_argument(
        "--max-tokens-ahead",
        type=int,
        dest="max_tokens_ahead",
        help="tokens generated past what a reader acknowledged before its generation pauses",
    )
    serve.add_argument(
        "--api-key",
        dest="api_key",
        help="accept this API key (prefer QUICSRV_API_KEY: arguments show in `ps`)",
    )
    serve.add_argument(
        "--api-keys-file",
        type=Path,
        dest="api_keys_file",
        help="hashed API keys, one per line (`quicsrv api-key new`); reread when it changes",
    )
    serve.add_argument(
        "--max-active-per-client",
        type=int,
        dest="max_active_per_client",
        help="generations one client (API key, or connection) runs at once",
    )
    serve.add_argument(
        "--max-queued-per-client",
        type=int,
        dest="max_queued_per_client",
        help="generations one client may have waiting for a slot",
    )
    serve.add_argument(
        "--rate-limit-rpm",
        type=int,
        dest="rate_limit_requests_per_minute",
        help="new generations per minute per API key (or source address); 0: none",
    )
    serve.add_argument(
        "--rate-limit-tpm",
        type=int,
        dest="rate_limit_tokens_per_minute",
        help="generated tokens per minute per API key (or source address); 0: none",
    )
    serve.add_argument(
        "--max-queue-wait",
        type=float,
        dest="max_queue_wait_s",
        help="seconds a new generation may wait for a slot before deadline_exceeded",
    )
    serve.add_argument(
        "--log-format",
        choices=[c.value for c in LogFormat],
        dest="log_format",
        help="plain lines (default) or one JSON object per line",
    )
    serve.add_argument(
        "--metrics-public",
        action="store_const",
        const=True,
        dest="metrics_public",
        help="serve GET /metrics without an API key even when keys are configured",
    )
    serve.add_argument(
        "--otel-exporter",
        choices=[c.value for c in OtelExporter],
        dest="otel_exporter",
        help="OpenTelemetry spans per generation (needs the `otel` extra); default none",
    )
    api_key = commands.add_parser("api-key", help="make API keys and their stored hashes")
    api_key_actions = api_key.add_subparsers(dest="action", required=True)
    new = api_key_actions.add_parser(
        "new", help="print a new key; its hash line goes to --append FILE (or is printed)"
    )
    new.add_argument("--name", default="", help="a label stored next to the hash")
    new.add_argument("--append", type=Path, help="keys file to append the hash line to")
    hash_ = api_key_actions.add_parser("hash", help="print the keys-file line for a key")
    hash_.add_argument("key", nargs="?", help="the key (default: read one line from stdin)")
    hash_.add_argument("--name", default="", help="a label stored next to the hash")
    keys = commands.add_parser("keys", help="manage the snapshot MAC keys")
    keys.add_argument("action", choices=["rotate"], help="make a new current key")
    keys.add_argument("--data-dir", type=Path, default=Path(".quicsrv"))
    keys.add_argument(
        "--store", default="file", help="file (the keyring under --data-dir) or redis://..."
    )
    keys.add_argument(
        "--previous-key-ttl",
        type=float,
        default=86400.0,
        help="seconds the replaced key keeps verifying older checkpoints",
    )
    certs = commands.add_parser("certs", help="create the dev CA and server certificate")
    certs.add_argument("--dir", type=Path, default=Path("certs"))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``quicsrv``; returns the exit status."""
    args = _parser().parse_args(argv)
    configure_logging("plain")
    try:
        if args.command == "certs":
            print(describe(ensure_dev_certs(args.dir)))
            return 0
        if args.command == "keys":
            if args.store not in ("", "file"):
                with _needs_server_extra():
                    return _rotate_shared_keys(args.store, args.previous_key_ttl)
            return _rotate_keys(args.data_dir, args.previous_key_ttl)
        if args.command == "api-key":
            return _api_key(args)
        return _serve(args)
    except ServerExtraMissing as exc:
        log.error("quicsrv %s: %s", args.command, exc)
        return EXIT_USAGE
    except OSError as exc:  # a file or directory that cannot be read or written
        log.error("quicsrv %s: %s", args.command, exc)
        return EXIT_FAILED


def _serve(args: argparse.Namespace) -> int:
    with _needs_server_extra():
        from . import app
    # Every serve flag's dest is a ServerConfig field; a flag left out is None (not given).
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServerConfig)}
    try:
        config = ServerConfig.load(args.config, **overrides)
        config.check()  # across fields, before anything starts
        configure_logging(config.log_format)
        for name in unknown_env_vars():
            log.warning("%s names no configuration key: ignored", name)
        configure_exporter(config.otel_exporter)
    except (ConfigError, ValueError, OSError, tomllib.TOMLDecodeError) as exc:
        log.error("cannot serve: %s", exc)
        return EXIT_USAGE
    if (problem := app.preflight(config)) is not None:
        log.error("cannot serve: %s", problem)
        return EXIT_USAGE
    if config.workers > 1:
        from .workers import run_workers

        return run_workers(config)
    return app.run(config)


class ServerExtraMissing(Exception):
    """A command needs a package only the ``server`` extra installs."""


@contextlib.contextmanager
def _needs_server_extra() -> Iterator[None]:
    """Turn a missing third-party module into :class:`ServerExtraMissing`: every module the
    base install lacks comes with the ``server`` extra (a missing module of our own is a bug,
    and stays a traceback)."""
    try:
        yield
    except ModuleNotFoundError as exc:
        package = (exc.name or "").partition(".")[0]
        if not package or package in _OWN_PACKAGES:
            raise
        raise ServerExtraMissing(
            f"needs the server extra (no module named {package!r}): pip install 'quicsrv[server]'"
        ) from None


def _api_key(args: argparse.Namespace) -> int:
    from .apikeys import hash_key, new_key

    if args.action == "new":
        key = new_key()
        line = f"{hash_key(key)} {args.name}".rstrip()
        if args.append is not None:
            with args.append.open("a") as out:
                out.write(line + "\n")
            args.append.chmod(0o600)
            print(key)
            print(f"# its hash was appended to {args.append}", file=sys.stderr)
        else:
            print(key)
            print(f"# keys-file line: {line}", file=sys.stderr)
        return 0
    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key:
        print("no key given", file=sys.stderr)
        return 2
    print(f"{hash_key(key)} {args.name}".rstrip())
    return 0


def _rotate_keys(data_dir: Path, previous_key_ttl_s: float) -> int:
    from .sessions.keys import KeyRing

    path = data_dir / "mac-keys.json"
    ring = KeyRing.load_or_create(path, previous_key_ttl_s=previous_key_ttl_s)
    ring.rotate(now_s=time.time())
    ring.save(path)
    print(
        f"rotated {path}: new checkpoints use a new key; older ones verify for "
        f"{previous_key_ttl_s:.0f}s (a running server reloads the file)"
    )
    return 0


def _rotate_shared_keys(url: str, previous_key_ttl_s: float) -> int:
    from .sessions.keys import SharedKeyRing
    from .sessions.persistence import KEYRING_KEY
    from .sessions.redis_store import connect

    ring = SharedKeyRing(connect(url), KEYRING_KEY, previous_key_ttl_s=previous_key_ttl_s)
    ring.rotate_shared(now_s=time.time())
    print(
        f"rotated the keyring in {url.rpartition('@')[2]}: every server sharing it signs with "
        f"the new key after its next sweep; older checkpoints verify for {previous_key_ttl_s:.0f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
