"""The local gateway: one OpenAI endpoint (default http://127.0.0.1:8420/v1) for every function deployed on this
machine with `--target local`, routing by the request's `model`, and scaling each function to zero when idle.

`control.py` starts and stops the process (`pkg deploy` starts it when needed, `pkg gateway` by hand),
`app.py` is its HTTP app, `body.py` how it reads a body (within the servers' limit, the key checked first),
`functions.py` what it knows of each deployment, `relay.py` and `upstream.py` the hop to a server (a server
that breaks off ends the stream with an error event), `lifecycle.py` the idle stop, the wake and the restart of
a server that ended, `models.py` the model cards (adapters included). It imports neither torch nor the engine:
it reads the deployments' records and relays bytes.
"""
