"""The local gateway: one OpenAI endpoint (default http://127.0.0.1:8420/v1) for every function deployed on this
machine with `--target local`, routing by the request's `model`, and scaling each function to zero when idle.

`control.py` starts and stops the process (`pkg deploy` starts it when needed, `pkg gateway` by hand),
`app.py` is its HTTP app, `functions.py` what it knows of each deployment, `lifecycle.py` the idle stop and
the wake. It imports neither torch nor the engine: it reads the deployments' records and relays bytes.
"""
