"""``quicsrv-client demo-resume``: cut a generation mid-stream, resume it, prove it is exact.

1. An uninterrupted reference run, timed token by token.
2. The same request again; after ``--cut-after`` tokens the connection is closed.
3. A new connection resumes from the last checkpoint; the seam is marked.
4. The joined token ids and text are compared with the reference, and the time from the resume
   request to its first new token is printed beside the time the reference took to reach the
   same token from scratch.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TextIO

from ._client import Client
from ._errors import ClientError
from ._events import GenerationEnded, ResumePosition, TokenReceived
from ._generation import Generation

__all__ = ["demo_resume"]

SEAM = "\u2702"  # scissors: where the connection was cut and the resume took over


async def demo_resume(
    args: argparse.Namespace, make_client: Callable[[argparse.Namespace], Client], out: TextIO
) -> int:
    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    def start(client: Client) -> Generation:
        return client.generate(
            args.prompt,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            seed=args.seed,
            ignore_eos=True,
        )

    say(f"reference run: {args.prompt!r}, {args.max_tokens} tokens, seed {args.seed}")
    reference_ids: list[int] = []
    reference_text: list[str] = []
    arrival_s: list[float] = []
    async with make_client(args) as client:
        started = time.perf_counter()
        async for event in start(client):
            if isinstance(event, TokenReceived):
                reference_ids.append(event.token_id)
                reference_text.append(event.text)
                arrival_s.append(time.perf_counter() - started)
            elif isinstance(event, GenerationEnded):
                reference_text.append(event.text)
    cut = min(args.cut_after, len(reference_ids) - 1)

    say(f"\ninterrupted run: the connection is cut after {cut} tokens")
    ids: list[int] = []
    text: list[str] = []
    position: ResumePosition | None = None
    client = make_client(args)
    await client.connect()
    generation = start(client)
    async for event in generation:
        if isinstance(event, TokenReceived):
            ids.append(event.token_id)
            text.append(event.text)
            out.write(event.text)
            out.flush()
            if len(ids) == cut:
                break
    position = generation.position
    await client.close()  # the cut: the stream and its connection are gone
    assert position is not None
    say(f" {SEAM}")
    say(
        f"cut after token index {position.last_index}; holding checkpoint "
        f"{position.checkpoint_index} ({position.snapshot_hash.hex()[:16]}...)"
    )

    say("\nresuming on a new connection:")
    first_new_s: float | None = None
    async with make_client(args) as client:
        requested = time.perf_counter()
        resumed = client.resume_from(position)
        out.write("".join(text) + f"[{SEAM}]")
        async for event in resumed:
            if isinstance(event, TokenReceived):
                if first_new_s is None:
                    first_new_s = time.perf_counter() - requested
                ids.append(event.token_id)
                text.append(event.text)
                out.write(event.text)
                out.flush()
            elif isinstance(event, GenerationEnded):
                text.append(event.text)
                out.write(event.text)
        say()
    try:
        identical = ids == reference_ids and "".join(text) == "".join(reference_text)
    except ClientError:  # pragma: no cover - raised inside the loops above
        identical = False
    say(f"\nserver rebuilt the decoder state by: {resumed.resume_path}")
    say(f"joined output identical to the uninterrupted run: {'yes' if identical else 'NO'}")
    if first_new_s is not None:
        scratch_s = arrival_s[cut]
        say(
            f"time to first resumed token: {first_new_s * 1000:.1f} ms; "
            f"regenerating from scratch to the same token: {scratch_s * 1000:.1f} ms"
        )
    return 0 if identical else 1
