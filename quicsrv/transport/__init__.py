"""aioquic glue: the HTTP/3 server. Knows nothing of llama.cpp."""

from .server import QuicServerApp, RunningServer, start_server

__all__ = ["QuicServerApp", "RunningServer", "start_server"]
