"""The OpenAI layer every frontend shares: request bodies in, OpenAI-shaped objects (or error bodies) out.

No transport here (no starlette, no SQS): the HTTP server (`runtime.http`), the queue worker
(`runtime.events`), Lambda (`runtime.aws_lambda`) and the edge agent all answer through these modules.

- `protocol` (with `fields`, `tools`, `structured_output`): request bodies validated into `SamplingParams`.
- `chat`, `completions`, `embeddings`, `classify`: each endpoint's semantics, submit and collect or stream.
- `service`: the model being served, its request policy and admission (503 while loading, 429 when full).
- `generation`: one request's engine streams; `grammar_compile`: grammars compiled off the event loop.
- `encoding`: JSON / msgpack bodies and stream framings; `errors`: OpenAI error bodies; `metrics`: Prometheus.
"""
