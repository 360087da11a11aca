"""The front door: every request, native or OpenAI's, over HTTP/3 or HTTP/1.1 + HTTP/2.

One router (:mod:`.router`) for every path and transport, exchanging :mod:`.messages` with the
transports; it only dispatches, each API's endpoints being a class of their own acting on the
sessions (:mod:`.native_endpoints`, :mod:`.completions_endpoints`, :mod:`.responses_endpoints`,
:mod:`.anthropic_endpoints`) and the operators' endpoints another (:mod:`.operator`).
:mod:`.native` reads native request frames and renders native refusals, :mod:`.openai_api` maps
OpenAI's requests and shapes its answers, :mod:`.anthropic_api` and :mod:`.anthropic_stream` do
so for Anthropic's Messages API, :mod:`.sse` writes a session's frames as events whose ids are
:mod:`.cursor`\\ s, and :mod:`.errors` is the one error table. The listeners are the
transport's (``quicsrv.transport``).
"""
