"""The HTTP API: OpenAI's completions over HTTP/3 and HTTP/1.1 + HTTP/2, with resumable SSE.

One routing layer (:mod:`.router`) for every transport; :mod:`.openai_api` maps requests and
shapes answers, :mod:`.sse` writes a session's frames as events whose ids are :mod:`.cursor`\\ s,
and :mod:`.tcp` is the TCP listener (hypercorn) beside the HTTP/3 one.
"""
