"""What a Ray deployment is on disk and on screen: its plan, and its record (`build/NAME/ray/state.json`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from packager.spec import FunctionSpec
from packager.targets.base import PlanRow
from packager.targets.local.records import ApiKey
from packager.targets.ray.local_head import LocalHead
from runtime.ray_serve.settings import ReplicaSettings

STATE_FILE = "state.json"


@dataclass(frozen=True)
class RayDeployment:
    function: str
    address: str  # the GCS the deploy talked to
    local_head: bool  # the head `pkg` started (stopped by the destroy of its last application)
    application: str
    route_prefix: str
    url: str  # Serve's proxy + route prefix, without /v1
    bundle_digest: str
    bundle_location: str  # where the nodes fetch it from
    settings_digest: str  # of the replica settings deployed: a change of any of them is an update
    api_key_source: str
    api_key_location: str
    scaling: str
    updated_at: float

    @property
    def api_key(self) -> ApiKey:
        return ApiKey(self.api_key_source, self.api_key_location)

    def summary(self) -> list[tuple[str, str]]:
        where = f"{self.address} (local head started by pkg)" if self.local_head else self.address
        return [
            ("url", f"[bold]{self.url}/v1[/] (Ray Serve's proxy; OpenAI-compatible)"),
            ("model", self.function),
            ("cluster", where),
            ("application", f"{self.application} at {self.route_prefix}"),
            ("bundle", f"{self.bundle_digest} from {self.bundle_location}"),
            ("scaling", self.scaling),
            ("api key", self.api_key.describe()),
        ]

    def next_step(self, function_dir: Path) -> str:
        return f'try it: pkg invoke {function_dir} "Hello!" --target ray'

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / STATE_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> RayDeployment | None:
        try:
            return cls(**json.loads((directory / STATE_FILE).read_text()))
        except FileNotFoundError:
            return None


@dataclass(frozen=True)
class RayPlan:
    spec: FunctionSpec
    address: str | None  # None: the local head
    head: LocalHead | None  # the local head when it runs already
    bundle: Path
    bundle_files: int  # the manifest and the files it lists
    store: str
    store_has_bundle: bool
    settings: ReplicaSettings
    settings_digest: str
    route_prefix: str
    api_key: ApiKey
    deployed: RayDeployment | None  # the record, when the application also still exists on the cluster
    application_state: str | None  # Serve's status of the application, None when it does not exist

    @property
    def where(self) -> str:
        return self.address or "a local Ray head on 127.0.0.1"

    @property
    def no_changes(self) -> bool:
        return all(action == "none" for action, *_ in self.rows())

    def rows(self) -> list[PlanRow]:
        rows: list[PlanRow] = []
        if self.address is None:
            head = "none" if self.head is not None else "create"
            rows.append((head, "ray-head", self.head.address if self.head else "127.0.0.1", "loopback, dashboard off"))
        fetched = f"{self.bundle_files} files; each node fetches it once into {self.settings.cache_dir}"
        rows.append(("none" if self.store_has_bundle else "create", "bundle", self.settings.bundle_location(), fetched))
        if self.application_state is None:
            app = "create"
        elif (
            self.deployed is not None
            and self.deployed.settings_digest == self.settings_digest
            and (self.application_state == "RUNNING")
        ):
            app = "none"
        else:
            app = "update"
        scaling = self.settings.deployment["autoscaling_config"]
        detail = f"route {self.route_prefix}; {scaling['min_replicas']}..{scaling['max_replicas']} replicas"
        rows.append((app, "serve-application", self.spec.name, detail))
        return rows
