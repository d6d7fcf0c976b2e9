"""The Ray Serve host: a function served by replicas of a Ray Serve deployment, behind Serve's proxy.

- `settings`: what a replica is told (the Serve application's `args`), shared with the packager's `ray` target.
- `function`: one replica's start, without Ray: the bundle by digest into the node's cache, then
  `runtime.startup` and the runtime's own HTTP app, as every other host.
- `app`: the Serve deployment and its application builder (`runtime.ray_serve.app:build`), the only module
  here that imports `ray` at the top; nothing else in the runtime imports it.
- `proxy_errors`: middleware for Serve's HTTP proxy, so its own answers (queue full, no replica, a replica lost
  mid-stream) reach clients as OpenAI-style errors, and a broken stream ends with an error event.
- `node_logs`: read the replicas' log files on one node (a Ray task runs it on each), for `pkg logs`.
"""
