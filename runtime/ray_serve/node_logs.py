"""The log files of a Serve application's replicas on one node, read on that node: `pkg logs --target ray` runs
`read_replica_logs` as a Ray task pinned to each node (no dashboard needed).

Serve writes each replica's log (its own lines, the runtime's, and the access log) to
`LOGS_DIR/serve/replica_APP_DEPLOYMENT_ID.log` on the replica's node; replica ids are unique in the cluster, so
a file's name says which replica it was, wherever it is read.
"""

from __future__ import annotations

import re
from pathlib import Path

_UNSAFE = re.compile(r"[^\x20-\x7E]|[<>:\"/\\|?*]")  # what Serve replaces with "_" in a file name (2.60)
MAX_BYTES = 4 << 20  # read at most this much of one file per call


def replica_log_pattern(app: str) -> str:
    name = _UNSAFE.sub("_", app)
    return f"replica_{name}_{name}_*.log"


def read_replica_logs(app: str, offsets: dict[str, int]) -> dict[str, tuple[int, list[str]]]:
    """Each replica log file of `app` on this node: its size now and its lines after `offsets[name]`."""
    logs = _node_logs_dir() / "serve"
    found: dict[str, tuple[int, list[str]]] = {}
    for path in sorted(logs.glob(replica_log_pattern(app))):
        start = offsets.get(path.name, 0)
        with path.open("rb") as handle:
            size = handle.seek(0, 2)
            start = start if start <= size else 0  # rotated: read the new file from its start
            handle.seek(max(start, size - MAX_BYTES))
            data = handle.read(MAX_BYTES)
        found[path.name] = (size, data.decode("utf-8", "replace").splitlines())
    return found


def _node_logs_dir() -> Path:
    """Where Ray keeps this node's logs (2.60 has no public accessor)."""
    import ray._private.worker

    node = ray._private.worker._global_node
    assert node is not None, "read_replica_logs runs as a Ray task, on a node"
    return Path(node.get_logs_dir_path())
