"""The engine's worker-thread hooks (:class:`EngineObserver`)."""

from __future__ import annotations

__all__ = ["EngineObserver"]


class EngineObserver:
    """Hooks around the worker thread's steps (the engine worker process meters and reports
    through them); every method is called on the engine thread and does nothing here."""

    def decode_started(self) -> None:
        """``llama_decode`` is about to run."""

    def decode_finished(self) -> None:
        """``llama_decode`` returned."""

    def step_finished(self) -> None:
        """A step ended: every sink callback of that step has been made."""

    def tokens_sampled(self) -> None:
        """Within a step, a call sampled tokens and more calls follow: what the sinks were told
        so far may leave now rather than after a long prompt's call (first tokens, a first
        text, an end: the server frees the slot for the next request that much sooner)."""

    def engine_failed(self, error: BaseException) -> None:
        """The worker thread stopped on an exception; every sequence got ``FAILED``."""
