"""The listeners: HTTP/3 over QUIC (aioquic) and, on the same port number, HTTP/1.1 and HTTP/2
over TCP (hypercorn), both handing every request to the one router. Knows nothing of llama.cpp."""

from .server import QuicServerApp, RunningServer, start_server

__all__ = ["QuicServerApp", "RunningServer", "start_server"]
