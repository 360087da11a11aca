"""Which frames a session's tokens become: TOKEN and signed CHECKPOINT frames, and the END
(and the other frames that end a reader's stream).

A function of the record (its tokens, spec and end), the tokens' pieces and the MAC key: every
reader, now or after a restart, on this process or another, is sent the same frames for the same
tokens. Tokens ``[i, j)`` leave in chunks that end at every ``every``-th token with the
CHECKPOINT of the prefix so far (or at ``j``): one write each, so a long replay is acknowledged
piece by piece, the reader holding a chunk's tokens once the chunk's last byte is acked. The END
carries the text held back until the end (the start of a stop sequence that never completed, an
unfinished UTF-8 sequence).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import quicsrv_proto
from quicsrv_proto import EndReason

from ..engine import TokenLogprobs
from .keys import KeyRing
from .record import SessionRecord
from .snapshot import PrefixSigner
from .text import TextAssembler

__all__ = ["Transcript"]


class Transcript:
    """The frames of one session's recorded tokens; grows as the record does (:meth:`add`)."""

    __slots__ = ("_every", "_keys", "_record", "_signer", "_tail", "_text", "_texts")

    def __init__(
        self,
        record: SessionRecord,
        *,
        keys: KeyRing,
        every: int,
        piece: Callable[[int], bytes],
    ) -> None:
        """``every``: tokens between checkpoints; ``piece``: a token's bytes (the vocabulary)."""
        self._record = record
        self._keys = keys
        self._every = every
        self._signer = PrefixSigner(record.snapshot(upto=0).header(), record.generated, every)
        self._text = TextAssembler(record.spec.stop)
        self._texts = [self._text.push(piece(t)) for t in record.generated]
        self._tail = self._closing_text() if record.end is not None else ""

    def __len__(self) -> int:
        """Tokens whose text is known: those recorded so far."""
        return len(self._texts)

    def add(self, piece: bytes) -> bool:
        """The piece of the token just recorded; whether a stop sequence completed with it."""
        text = self._text
        self._texts.append(text.push(piece))
        return text.stopped

    def close(self) -> None:
        """The record has ended: the text held back goes out with the END (none after a stop
        sequence, which ends the text before it)."""
        self._tail = self._closing_text()

    def chunks(self, start: int, stop: int) -> Iterator[tuple[int, list[quicsrv_proto.Frame]]]:
        """The frames of tokens ``[start, stop)``, one chunk per write: ``(end, frames)``, the
        chunk holding the tokens before ``end``, its last a CHECKPOINT where ``end`` is a
        multiple of ``every``."""
        generated, texts, every = self._record.generated, self._texts, self._every
        logprobs = self._record.logprobs
        chunk: list[quicsrv_proto.Frame] = []
        for i in range(start, stop):
            if logprobs is None:
                token = quicsrv_proto.Token(index=i, token_id=generated[i], text=texts[i])
            else:
                token = _with_logprobs(i, generated[i], texts[i], logprobs[i])
            chunk.append(token)
            if (i + 1) % every == 0:
                chunk.append(self.checkpoint(i))
                yield i + 1, chunk
                chunk = []
        if chunk:
            yield stop, chunk

    def checkpoint(self, index: int) -> quicsrv_proto.Checkpoint:
        """The CHECKPOINT of the tokens up to ``index`` (-1: the prompt alone, before any)."""
        record = self._record
        snapshot_hash = self._signer.mac(self._keys.current, index)
        return quicsrv_proto.Checkpoint(
            session_id=record.session_id, index=index, snapshot_hash=snapshot_hash
        )

    def pause_checkpoint(self, sent: int, paused_at: int) -> quicsrv_proto.Checkpoint | None:
        """The CHECKPOINT that tells a reader sent the tokens before ``sent`` that the engine
        paused after ``paused_at`` tokens: only where both are the recorded tokens' end. The
        engine may have run past the record (tokens after a stop sequence, or decoded by a
        stale copy): those have no checkpoint."""
        if sent == len(self._record.generated) == paused_at:
            return self.checkpoint(paused_at - 1)
        return None

    def end(self) -> quicsrv_proto.End:
        """The END of the ended record, after its last token."""
        record = self._record
        assert record.end is not None
        return quicsrv_proto.End(
            reason=record.end.reason,
            prompt_tokens=len(record.spec.prompt_tokens),
            completion_tokens=record.end.completion_tokens,
            text=self._tail,
            cached_tokens=record.cached_tokens,
        )

    def superseded(self, failure: str | None = None) -> quicsrv_proto.Frame:
        """What ends a reader's stream when a newer reader took the session (here, or in another
        process): END(superseded); or, with ``failure``, ERROR(store_unavailable) when the shared
        store failed (the reader may resume once it is back)."""
        if failure is None:
            return quicsrv_proto.End(reason=EndReason.SUPERSEDED)
        return quicsrv_proto.Error(code=quicsrv_proto.ErrorCode.STORE_UNAVAILABLE, message=failure)

    def shutdown(self, sent: int) -> quicsrv_proto.End:
        """END(shutdown) for a reader sent the tokens before ``sent``: no end, the session stays
        resumable (from the next server process)."""
        record = self._record
        return quicsrv_proto.End(
            reason=EndReason.SHUTDOWN,
            prompt_tokens=len(record.spec.prompt_tokens),
            completion_tokens=sent,
            cached_tokens=record.cached_tokens,
        )

    def _closing_text(self) -> str:
        assert self._record.end is not None
        return "" if self._record.end.reason is EndReason.STOP else self._text.finish()


def _with_logprobs(
    index: int, token_id: int, text: str, logprobs: TokenLogprobs
) -> quicsrv_proto.Token:
    """A TOKEN with its log-probabilities (none where they are unknown: NaN in the log)."""
    if math.isnan(logprobs.logprob):
        return quicsrv_proto.Token(index=index, token_id=token_id, text=text)
    return quicsrv_proto.Token(
        index=index,
        token_id=token_id,
        text=text,
        logprob=logprobs.logprob,
        top_logprobs=logprobs.top,
    )
