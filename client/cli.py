"""``quicsrv-client``: stream a generation from a quicsrv server to the terminal.

``generate`` starts one, ``resume`` continues an interrupted one from its session, last token
index and checkpoint hash (all printed by ``generate --json``), and ``demo-resume`` shows a cut
and an exact resume end to end.

Exit status: 0 the generation ended (length, stop, eos, cancelled), 1 server error (ERROR frame
or malformed response), 2 usage error, 3 transport error (cannot connect, connection lost),
4 the stream ended but the generation did not (the server went away and auto-resume was off,
or another reader took the session over): the ``quicsrv-client resume`` command that continues
it is printed, 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from typing import TextIO

import quicsrv_proto

from ._client import Client
from ._errors import ClientError, ProtocolError, ServerError, TransportError
from ._events import (
    CheckpointReceived,
    Event,
    GenerationEnded,
    Reconnected,
    SessionStarted,
    TokenReceived,
)
from ._generation import Generation
from ._options import DEFAULT_CA, DEFAULT_STALL_TIMEOUT_S, ClientConfig, SamplingOptions
from ._reconnect import ReconnectPolicy
from ._tickets import default_ticket_cache_path

__all__ = ["build_parser", "main", "render_error_json", "render_event_json"]

EXIT_OK = 0
EXIT_SERVER_ERROR = 1
EXIT_USAGE = 2
EXIT_TRANSPORT_ERROR = 3
EXIT_NOT_ENDED = 4
EXIT_INTERRUPTED = 130


def render_event_json(event: Event) -> str:
    """One event as a single-line JSON object (the ``--json`` output format)."""
    obj: dict[str, object]
    if isinstance(event, SessionStarted):
        obj = {"type": "session", "session": event.session_id}
        if event.resume_path is not None:
            obj["resume_path"] = event.resume_path
        if event.early_data:
            obj["early_data"] = True
    elif isinstance(event, TokenReceived):
        obj = {"type": "token", "index": event.index, "id": event.token_id, "text": event.text}
    elif isinstance(event, Reconnected):
        obj = {
            "type": "reconnect",
            "attempt": event.attempt,
            "last_index": event.last_index,
            "early_data": event.early_data,
            "delay_s": round(event.delay_s, 3),
            "error": event.error,
        }
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


def _add_connection_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="localhost")
    parser.add_argument("--port", type=int, default=4433)
    parser.add_argument("--ca", default=DEFAULT_CA, help=f"CA certificate (default {DEFAULT_CA})")
    parser.add_argument(
        "--insecure-skip-verify",
        action="store_true",
        help="do not verify the server certificate (development only)",
    )
    parser.add_argument("--connect-timeout", type=float, default=10.0, metavar="SECONDS")
    parser.add_argument(
        "--no-auto-resume",
        dest="auto_resume",
        action="store_false",
        help="fail on a lost connection instead of reconnecting and resuming",
    )
    parser.add_argument(
        "--reconnect-attempts",
        type=int,
        default=ReconnectPolicy().max_attempts,
        help="consecutive reconnects before giving up (the default rides out a server restart)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="sent as `authorization: Bearer` (default: the QUICSRV_API_KEY variable)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=DEFAULT_STALL_TIMEOUT_S,
        metavar="SECONDS",
        help="silence after a token that counts as a lost stream (0 = wait forever)",
    )
    parser.add_argument(
        "--ticket-cache",
        default=None,
        help="TLS session tickets for 0-RTT (default: ~/.cache/quicsrv/tickets.json; '' = none)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quicsrv-client", description="Stream LLM tokens from a quicsrv server over HTTP/3."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("prompt", help="the prompt (the user turn with --chat/--system)")
    _add_connection_args(gen)
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repeat-penalty", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop sequence (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--deadline-ms",
        type=int,
        default=None,
        help="give up unless generation starts within this many milliseconds",
    )
    gen.add_argument("--chat", action="store_true", help="send PROMPT as a chat user turn")
    gen.add_argument("--system", default=None, help="system turn (implies --chat)")
    gen.add_argument("--json", action="store_true", help="one JSON object per event per line")
    res = sub.add_parser("resume", help="continue an interrupted generation")
    _add_connection_args(res)
    res.add_argument("--session", required=True, help="session id (hex) from generate --json")
    res.add_argument(
        "--from-index",
        type=int,
        required=True,
        help="the last token index you hold (-1: none); output starts after it",
    )
    res.add_argument("--hash", required=True, help="a checkpoint hash (hex) of the session")
    res.add_argument(
        "--checkpoint-index",
        type=int,
        default=None,
        help="the index that hash names (default: --from-index)",
    )
    res.add_argument("--json", action="store_true", help="one JSON object per event per line")
    demo = sub.add_parser(
        "demo-resume", help="cut a generation mid-stream, resume it, check it is exact"
    )
    _add_connection_args(demo)
    demo.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    demo.add_argument("--max-tokens", type=int, default=96)
    demo.add_argument("--cut-after", type=int, default=40, help="tokens received before the cut")
    demo.add_argument("--seed", type=int, default=7)
    demo.add_argument("--temperature", type=float, default=0.8)
    return parser


def _client(args: argparse.Namespace) -> Client:
    cache = args.ticket_cache
    config = ClientConfig(
        ca=args.ca,
        insecure_skip_verify=args.insecure_skip_verify,
        connect_timeout_s=args.connect_timeout,
        reconnect=ReconnectPolicy(max_attempts=args.reconnect_attempts)
        if args.auto_resume
        else None,
        stall_timeout_s=args.stall_timeout or None,
    )
    if args.api_key is not None:  # else the config's default: $QUICSRV_API_KEY
        config = config.replace(api_key=args.api_key)
    return Client(
        args.host,
        args.port,
        config=config,
        ticket_cache=default_ticket_cache_path() if cache is None else (cache or None),
    )


def _open(args: argparse.Namespace, client: Client) -> Generation:
    if args.command == "resume":
        try:
            snapshot_hash = bytes.fromhex(args.hash)
        except ValueError:
            raise ValueError("--hash is not hex") from None
        return client.resume(
            args.session,
            args.from_index,
            snapshot_hash,
            checkpoint_index=args.checkpoint_index,
        )
    prompt: str | None = args.prompt
    messages: list[quicsrv_proto.ChatMessage] | None = None
    if args.chat or args.system is not None:
        messages = []
        if args.system is not None:
            messages.append(quicsrv_proto.ChatMessage(role="system", content=args.system))
        messages.append(quicsrv_proto.ChatMessage(role="user", content=args.prompt))
        prompt = None
    sampling = SamplingOptions(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )
    return client.stream(prompt, messages=messages, sampling=sampling, deadline_ms=args.deadline_ms)


async def _stream(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    client = _client(args)
    printed_text = False
    generation: Generation | None = None
    ended: GenerationEnded | None = None
    try:
        async with client:
            generation = _open(args, client)
            async for event in generation:
                if isinstance(event, GenerationEnded):
                    ended = event
                if args.json:
                    print(render_event_json(event), file=out, flush=True)
                elif isinstance(event, TokenReceived):
                    out.write(event.text)
                    out.flush()
                    printed_text = True
                elif isinstance(event, Reconnected):
                    print(
                        f"\n[connection lost ({event.error}); resumed after token "
                        f"{event.last_index}{', 0-RTT' if event.early_data else ''}]",
                        file=err,
                        flush=True,
                    )
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
        _print_resume_hint(generation, err)
        return EXIT_TRANSPORT_ERROR
    except ClientError as exc:  # pragma: no cover - every ClientError is one of the above
        _finish_line(out, printed_text)
        print(f"error: {exc}", file=err, flush=True)
        return EXIT_SERVER_ERROR
    if ended is None or not ended.reason.ends_generation:
        # With --json too: the end event named the reason, this says what to do about it.
        reason = "no end" if ended is None else ended.reason.value
        print(f"the generation did not end ({reason}): it can be resumed", file=err, flush=True)
        _print_resume_hint(generation, err)
        return EXIT_NOT_ENDED
    return EXIT_OK


def _print_resume_hint(generation: Generation | None, err: TextIO) -> None:
    position = generation.position if generation is not None else None
    if position is None:
        return
    print(
        f"resume with: quicsrv-client resume --session {position.session_id} "
        f"--from-index {position.last_index} --hash {position.snapshot_hash.hex()} "
        f"--checkpoint-index {position.checkpoint_index}",
        file=err,
        flush=True,
    )


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
        if args.command == "demo-resume":
            from ._demo import demo_resume

            return asyncio.run(demo_resume(args, _client, sys.stdout))
        return asyncio.run(_stream(args, sys.stdout, sys.stderr))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
