"""Sessions: generations that outlive their streams. Knows nothing of aioquic or HTTP.

Import from the modules: ``manager`` (:class:`~.manager.SessionManager`, the front ends' one way
in), ``session`` (a live session), ``attachment`` (the stream port a transport gives it),
``settings``, ``spec`` and ``record`` (what a generation is and what is known of it),
``generation`` (a GENERATE checked and turned into a spec), ``errors`` (refusals and their wire
codes), ``store`` (the store protocol; ``persistence`` opens one) and the KV spill. The package
itself imports nothing, so that importing one module loads only what that module needs.
"""
