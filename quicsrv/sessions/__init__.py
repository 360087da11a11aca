"""Streams of generations: turning engine output into frames. Knows nothing of aioquic."""

from .generation import GenerationStream, RequestRejected, build_request

__all__ = ["GenerationStream", "RequestRejected", "build_request"]
