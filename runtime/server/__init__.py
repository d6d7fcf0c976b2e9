"""The OpenAI-compatible HTTP frontend: a starlette app over the engine, run by `python -m runtime serve`.

- `app`: routes, auth, the engine's lifecycle; `serve`: the command line and uvicorn.
- `protocol` (with `fields`): request bodies validated into the engine's `SamplingParams`.
- `chat`, `completions`: the two generation endpoints; `generation`: submit, merge, cancel.
- `encoding`: JSON / msgpack / SSE; `errors`: OpenAI error bodies; `disconnect`: cancel on client loss.
- `auth`, `metrics`, `state`, `formatting`: bearer keys, Prometheus, shared state, response pieces.
"""
