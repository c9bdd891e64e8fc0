"""The OpenAI-compatible server and the text layer under it (floor 6, beside ``api``).

``detokenizer`` (incremental detokenisation, stop strings), ``templates`` (chat messages →
prompt ids), ``protocol`` (request checks, OpenAI errors), ``generation`` (one request's
choices over the async engine), ``metrics`` (Prometheus), ``app`` (the Starlette app),
``server`` (uvicorn: foreground with graceful shutdown, or a background thread).
Nothing is imported here, so ``optimized_model`` can use the detokeniser without pulling
in the HTTP stack.
"""
