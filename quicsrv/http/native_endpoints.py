"""The native frame API's endpoints: what ``POST /v1/generate`` and ``POST /v1/resume`` do, on
the sessions (the router dispatches here over HTTP/3; :mod:`.native` reads the request frames
and encodes the answer's frames, sans-I/O).

A GENERATE opens a session whose frames stream back from the first; a RESUME_STREAM reattaches
to one (its id in the frame and the ``quicsrv-session`` header) after the last index the client
holds, through the session manager's checks (the snapshot hash, the record, the API key that
made it). A resume is harmless twice, so it is answered from 0-RTT data too: the answer then
says so (``quicsrv-early-data: 1``) and is counted in :attr:`NativeEndpoints.early_resumes`.
"""

from __future__ import annotations

from quicsrv_proto.http3 import EARLY_DATA_HEADER, RESUME_PATH_HEADER, SESSION_HEADER

from ..apikeys import ClientId
from ..sessions.manager import SessionManager
from ..sessions.session import Session
from . import native
from .messages import HttpRequest, SessionStream

__all__ = ["NativeEndpoints"]


class NativeEndpoints:
    """See the module docstring."""

    def __init__(self, *, sessions: SessionManager, max_body_bytes: int) -> None:
        self._sessions = sessions
        self._max_body_bytes = max_body_bytes
        self.early_resumes = 0
        """Resumes answered from 0-RTT data."""

    async def generate(self, request: HttpRequest, who: ClientId) -> SessionStream:
        """``POST /v1/generate``: the new session's frames, from the first."""
        frame = native.read_generate(request.body, max_payload_bytes=self._max_body_bytes)
        session = await self._sessions.open_generation(
            frame,
            client=who.name,
            owner=who.key_id or "",
            arrived_at=request.arrived_at,
            quota=who.quota,
        )
        return _frames(session, 0, who, fresh=True)

    async def resume(self, request: HttpRequest, who: ClientId) -> SessionStream:
        """``POST /v1/resume``: the session's frames after the last index the client holds,
        and how it was brought back (``quicsrv-resume-path``)."""
        resume, header_session = native.read_resume(
            request.body,
            request.headers.get(SESSION_HEADER),
            max_payload_bytes=self._max_body_bytes,
        )
        session = await self._sessions.resume(resume, header_session, key_id=who.key_id)
        headers: tuple[tuple[bytes, bytes], ...] = ()
        if request.early_data:
            self.early_resumes += 1
            headers += ((EARLY_DATA_HEADER, b"1"),)
        planned = session.planned_resume_path()
        shown = b"none" if planned is None else planned.value.encode()
        headers += ((RESUME_PATH_HEADER, shown),)
        return _frames(session, resume.last_index + 1, who, fresh=False, headers=headers)


def _frames(
    session: Session,
    from_index: int,
    who: ClientId,
    *,
    fresh: bool,
    headers: tuple[tuple[bytes, bytes], ...] = (),
) -> SessionStream:
    """The answer: ``session``'s frames from ``from_index``, its id in ``quicsrv-session``."""
    return SessionStream(
        session=session,
        from_index=from_index,
        encode=native.encode_frames,
        content_type=native.FRAMES,
        headers=((SESSION_HEADER, session.session_id.hex().encode()), *headers),
        client=who.name,
        fresh=fresh,
    )
