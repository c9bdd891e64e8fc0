"""The OpenAI-compatible server (floor 6, beside ``api``).

``protocol`` (request checks, OpenAI errors), ``generation`` (one request's choices over the
async engine), ``metrics`` (Prometheus), ``tracing`` (OpenTelemetry), ``app`` (the Starlette
app), ``server`` (uvicorn: foreground with graceful shutdown, or a background thread). The text
layer under it (detokeniser, chat templates, logprob shapes) is :mod:`devin_compile.text`.
"""
