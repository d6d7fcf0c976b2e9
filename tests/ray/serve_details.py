"""Print Serve's record of the cluster as JSON: every application, its replicas with their nodes and pids, and each
live node's custom resources. Run inside the cluster's namespace (tests/ray/cluster.py), as a driver."""

from __future__ import annotations

import json
import logging
import sys

import ray
from ray.serve.context import _get_global_client

ray.init(address=sys.argv[1], namespace="serve", log_to_driver=False, logging_level=logging.WARNING)
details = _get_global_client().get_serve_details()
nodes = {
    node["NodeID"]: sorted(k for k in node["Resources"] if k not in ("CPU", "memory", "object_store_memory")
                           and not k.startswith("node:"))
    for node in ray.nodes()
    if node["Alive"]
}  # fmt: skip
apps = {}
for name, app in details.get("applications", {}).items():
    replicas = [
        {**{k: r.get(k) for k in ("replica_id", "state", "pid", "node_id")}, "node": nodes.get(r.get("node_id"))}
        for deployment in app["deployments"].values()
        for r in deployment["replicas"]
    ]
    apps[name] = {"status": app["status"], "message": app.get("message", ""), "replicas": replicas}
print(json.dumps({"applications": apps, "nodes": nodes}))
ray.shutdown()
