"""Pushing bundles to edge agents: the archive, the HTTP client, and the fan-out to many devices."""
