"""Sessions: generations that outlive their streams. Knows nothing of aioquic.

Import from the modules: ``manager`` (:class:`~.manager.SessionManager`, its settings),
``session`` (a live session, its stream port, flow settings), ``generation`` (a request checked
and turned into an engine request), ``lifecycle`` (the state table and the resume-conflict
policy), the stores and the KV spill. The package itself imports nothing, so that the
configuration can name its choices without Redis, Prometheus or llama.cpp installed.
"""
