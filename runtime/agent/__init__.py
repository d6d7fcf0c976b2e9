"""The edge agent (`python -m runtime agent`): serves the current bundle and installs new ones safely.

- `layout`: the bundle root on disk (uploads, staging, bundles, the `current`/`previous` links) and crash recovery.
- `uploads`: resumable uploads of a bundle archive, addressed by the archive's sha256.
- `unpack`: extracting an archive while refusing anything that could escape the target folder.
- `serving`: the running bundle behind the runtime's own HTTP app, swapped without dropping requests.
- `install`: verify → unpack → load in a fresh engine → smoke test → switch; rollback; start-up recovery.
- `history`: the append-only log of installs and rollbacks `GET /agent/status` reports.
- `routes`: the authenticated `/agent/*` HTTP API; `command`: the command line and uvicorn (TLS, mTLS).
- `greengrass_launcher`: the Greengrass component's `Run` step on a core device (stdlib only, shipped as an
  artifact by `pkg deploy --target greengrass`), which starts the agent and hands it the deployed bundle.
"""
