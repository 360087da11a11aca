"""``quicsrv-client``: stream a generation from a quicsrv server to the terminal.

Exit status: 0 success, 1 server error (ERROR frame or malformed response), 2 usage error,
3 transport error (cannot connect, connection lost), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import TextIO

import proto

from ._client import DEFAULT_CA, Client
from ._errors import ClientError, ProtocolError, ServerError, TransportError
from ._events import (
    CheckpointReceived,
    Event,
    GenerationEnded,
    SessionStarted,
    TokenReceived,
)

__all__ = ["build_parser", "main", "render_error_json", "render_event_json"]

EXIT_OK = 0
EXIT_SERVER_ERROR = 1
EXIT_TRANSPORT_ERROR = 3
EXIT_INTERRUPTED = 130


def render_event_json(event: Event) -> str:
    """One event as a single-line JSON object (the ``--json`` output format)."""
    obj: dict[str, object]
    if isinstance(event, SessionStarted):
        obj = {"type": "session", "session": event.session_id}
    elif isinstance(event, TokenReceived):
        obj = {"type": "token", "index": event.index, "id": event.token_id, "text": event.text}
    elif isinstance(event, CheckpointReceived):
        obj = {"type": "checkpoint", "index": event.index, "hash": event.snapshot_hash.hex()}
    elif isinstance(event, GenerationEnded):
        obj = {
            "type": "end",
            "reason": event.reason.value,
            "prompt_tokens": event.prompt_tokens,
            "completion_tokens": event.completion_tokens,
            "text": event.text,
        }
    else:  # pragma: no cover - exhaustive over Event
        raise TypeError(f"not an event: {event!r}")
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def render_error_json(error: ServerError | ProtocolError) -> str:
    """A server or protocol error as a ``{"type": "error", ...}`` JSON line."""
    if isinstance(error, ServerError):
        obj: dict[str, object] = {
            "type": "error",
            "code": error.code,
            "name": error.slug,
            "message": error.message,
        }
        if error.http_status is not None:
            obj["http_status"] = error.http_status
        if error.retry_after_s is not None:
            obj["retry_after_s"] = error.retry_after_s
    else:
        obj = {
            "type": "error",
            "code": int(error.error_code),
            "name": error.error_code.slug,
            "message": error.message,
        }
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quicsrv-client", description="Stream LLM tokens from a quicsrv server over HTTP/3."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", help="the prompt (the user turn with --chat/--system)")
    gen.add_argument("--host", default="localhost")
    gen.add_argument("--port", type=int, default=4433)
    gen.add_argument("--ca", default=DEFAULT_CA, help=f"CA certificate (default {DEFAULT_CA})")
    gen.add_argument(
        "--insecure-skip-verify",
        action="store_true",
        help="do not verify the server certificate (development only)",
    )
    gen.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repeat-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--chat", action="store_true", help="send PROMPT as a chat user turn")
    gen.add_argument("--system", default=None, help="system turn (implies --chat)")
    gen.add_argument("--json", action="store_true", help="one JSON object per event per line")
    return parser


async def _generate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    prompt: str | None = args.prompt
    messages: list[proto.ChatMessage] | None = None
    if args.chat or args.system is not None:
        messages = []
        if args.system is not None:
            messages.append(proto.ChatMessage(role="system", content=args.system))
        messages.append(proto.ChatMessage(role="user", content=args.prompt))
        prompt = None
    client = Client(
        args.host,
        args.port,
        ca=args.ca,
        insecure_skip_verify=args.insecure_skip_verify,
        connect_timeout_s=args.connect_timeout,
    )
    printed_text = False
    try:
        async with client:
            async for event in client.generate(
                prompt,
                messages=messages,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                min_p=args.min_p,
                repeat_penalty=args.repeat_penalty,
                seed=args.seed,
                stop=tuple(args.stop),
                ignore_eos=args.ignore_eos,
            ):
                if args.json:
                    print(render_event_json(event), file=out, flush=True)
                elif isinstance(event, TokenReceived):
                    out.write(event.text)
                    out.flush()
                    printed_text = True
                elif isinstance(event, GenerationEnded):
                    out.write(event.text + "\n")
                    out.flush()
                    printed_text = False
                    print(
                        f"[end: {event.reason.value}, {event.completion_tokens} tokens]",
                        file=err,
                        flush=True,
                    )
    except (ServerError, ProtocolError) as exc:
        _finish_line(out, printed_text)
        if args.json:
            print(render_error_json(exc), file=out, flush=True)
        else:
            print(f"error: {exc}", file=err, flush=True)
        return EXIT_SERVER_ERROR
    except TransportError as exc:
        _finish_line(out, printed_text)
        print(f"error: {exc}", file=err, flush=True)
        return EXIT_TRANSPORT_ERROR
    except ClientError as exc:  # pragma: no cover - every ClientError is one of the above
        _finish_line(out, printed_text)
        print(f"error: {exc}", file=err, flush=True)
        return EXIT_SERVER_ERROR
    return EXIT_OK


def _finish_line(out: TextIO, printed_text: bool) -> None:
    if printed_text:
        out.write("\n")
        out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``quicsrv-client``; returns the exit status."""
    args = build_parser().parse_args(argv)
    if getattr(args, "insecure_skip_verify", False):
        print(
            "WARNING: --insecure-skip-verify: the server certificate is NOT verified",
            file=sys.stderr,
            flush=True,
        )
    try:
        return asyncio.run(_generate(args, sys.stdout, sys.stderr))
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
