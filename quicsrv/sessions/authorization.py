"""Who may resume, read or stop a session: pure checks, in an order that tells an
unauthenticated peer nothing.

Unknown or expired session first (the id alone is unguessable; :class:`~.manager.SessionManager`
answers those, since an expiry changes the store), then the snapshot hash (constant-time, every
live key), and only then what the hash holder may learn: key mismatch, model changed, index beyond
the snapshot, session busy. Each check raises :class:`~.errors.RequestRejected`.
"""

from __future__ import annotations

import hmac

import quicsrv_proto
from quicsrv_proto import ErrorCode

from ..config import ResumeConflict
from .errors import RequestRejected
from .record import SessionRecord

__all__ = ["check_admit", "check_hash", "check_owner", "reattach_index"]


def check_hash(
    frame: quicsrv_proto.ResumeStream,
    header_session: bytes | None,
    record: SessionRecord,
    verifying_keys: list[bytes],
) -> None:
    """The RESUME_STREAM names this record and holds a MAC of a prefix of it."""
    if header_session is not None and header_session != frame.session_id:
        raise RequestRejected(
            ErrorCode.INVALID_FIELD, "the quicsrv-session header and RESUME_STREAM disagree"
        )
    # The hash names a prefix the server persisted before telling anyone its hash, so a hash
    # index past what is recorded cannot be genuine.
    hash_index = frame.checkpoint_index
    valid = hash_index < len(record.generated) and record.snapshot(upto=hash_index + 1).verify(
        verifying_keys, hash_index, frame.snapshot_hash
    )
    if not valid:
        raise RequestRejected(
            ErrorCode.HASH_MISMATCH, "the snapshot hash does not verify for this session"
        )


def check_owner(record: SessionRecord, key_id: str | None) -> None:
    """A session started with an API key is read, resumed or stopped only with that key."""
    if (
        key_id is not None
        and record.owner
        and not hmac.compare_digest(key_id.encode(), record.owner.encode())
    ):
        raise RequestRejected(
            ErrorCode.SESSION_KEY_MISMATCH, "the session was started with another API key"
        )


def check_admit(
    record: SessionRecord,
    *,
    from_index: int,
    key_id: str | None,
    model_digest: bytes,
    read_elsewhere: bool,
    on_conflict: ResumeConflict,
) -> None:
    """The checks only an authenticated resumer may learn the outcome of (``read_elsewhere``:
    another stream of this process reads the session now)."""
    check_owner(record, key_id)
    if record.model_digest != model_digest:
        raise RequestRejected(
            ErrorCode.MODEL_CHANGED, "the server runs a different model than the session's"
        )
    if from_index > len(record.generated):
        raise RequestRejected(
            ErrorCode.INDEX_BEYOND_SNAPSHOT,
            f"last_index {from_index - 1} is beyond the snapshot ({len(record.generated)} tokens)",
        )
    if read_elsewhere and on_conflict is ResumeConflict.REFUSE:
        raise RequestRejected(ErrorCode.SESSION_BUSY, "another stream is reading this session")


def reattach_index(record: SessionRecord, from_index: int) -> int:
    """Past the last token of an ended session means the reader had every token: only the
    END is left to send, from the recorded count."""
    return min(from_index, len(record.generated)) if record.end is not None else from_index
