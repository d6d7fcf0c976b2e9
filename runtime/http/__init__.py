"""The HTTP transport: a starlette app over the OpenAI layer (`runtime.api`), run by `python -m runtime serve`.

- `serve`: the command line and uvicorn; `app`: routes, probes, the engine's lifecycle.
- `endpoints`: the POST routes a bundle's task serves; `sagemaker`: `/ping` and `/invocations`.
- `auth`, `state`, `responses`, `disconnect`: bearer keys, the app's state, wire responses, cancel on client loss.
- `connections`, `connection_limits`: what one connection may cost (headers, timeouts, the socket cap).
- `openapi`, `openapi_generation`, `openapi_routes`: the `/openapi.json` document.
"""
