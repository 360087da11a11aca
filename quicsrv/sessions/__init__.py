"""Sessions: generations that outlive their streams. Knows nothing of aioquic."""

from .generation import RequestRejected, build_request
from .manager import ResumeConflict, SessionManager, SessionSettings
from .session import FlowSettings, Session, StreamPort

__all__ = [
    "FlowSettings",
    "RequestRejected",
    "ResumeConflict",
    "Session",
    "SessionManager",
    "SessionSettings",
    "StreamPort",
    "build_request",
]
