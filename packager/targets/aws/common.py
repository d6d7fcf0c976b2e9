"""What every AWS target shares: the session (region, endpoint, account), tags, errors, and plan/apply.

A target describes the resources it wants as `Resource`s (a kind, a name, and the settings that matter),
each handled by a `Driver` that can read the current settings back, create, update and delete. `plan`
reads every resource and compares setting by setting, so a second deploy with no change is "no changes",
and a deploy interrupted halfway is resumed by the next one: names are deterministic, and whatever
exists is read back rather than remembered. The endpoint comes from configuration only
(`endpoint_url` in the spec or `AWS_ENDPOINT_URL`, which boto3 reads): the code never knows whether it
talks to AWS or to a local stand-in.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from packager.errors import UserError

if TYPE_CHECKING:
    from botocore.exceptions import ClientError

T = TypeVar("T")

TAG_FUNCTION = "onnxfn:function"
TAG_BUNDLE = "onnxfn:bundle-digest"
TAG_TARGET = "onnxfn:target"
# Error codes AWS uses when an account quota or a service limit stops a request.
QUOTA_CODES = frozenset({
    "LimitExceededException", "ResourceLimitExceeded", "ServiceQuotaExceededException", "TooManyRequestsException",
    "CodeStorageExceededException", "QuotaExceededException", "Throttling", "ThrottlingException",
})  # fmt: skip
QUOTA_MESSAGES = ("UnreservedConcurrentExecution", "quota", "limit exceeded", "Limit Exceeded")
CREDENTIAL_CODES = frozenset({
    "InvalidClientTokenId", "UnrecognizedClientException", "SignatureDoesNotMatch", "ExpiredToken",
    "ExpiredTokenException", "AuthFailure", "InvalidAccessKeyId",
})  # fmt: skip


@dataclass
class AwsContext:
    """One account and region, reached through one endpoint; clients are made on first use."""

    session: Any  # boto3.Session
    region: str
    endpoint_url: str | None
    account: str
    partition: str
    target: str
    _clients: dict[str, Any] = field(default_factory=dict, repr=False)

    def client(self, service: str) -> Any:
        if service not in self._clients:
            from botocore.config import Config

            config = Config(connect_timeout=5, read_timeout=60, retries={"mode": "standard", "max_attempts": 3})
            self._clients[service] = self.session.client(
                service, region_name=self.region, endpoint_url=self.endpoint_url, config=config
            )
        return self._clients[service]

    def arn(self, service: str, resource: str, *, regional: bool = True) -> str:
        region = self.region if regional else ""
        account = "" if service == "s3" else self.account
        return f"arn:{self.partition}:{service}:{region}:{account}:{resource}"

    @property
    def dns_suffix(self) -> str:
        return "amazonaws.com.cn" if self.partition == "aws-cn" else "amazonaws.com"


def resolve_region(region: str | None, target: str) -> tuple[str, str]:
    """The region to use and where it came from: `targets.TARGET.region`, then `$AWS_REGION` (what Lambda and
    the AWS CLI v2 set; boto3 does not read it), then boto3's own `$AWS_DEFAULT_REGION` and the profile's
    `region` in ~/.aws/config."""
    if region:
        return region, f"targets.{target}.region"
    for variable in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        if os.environ.get(variable):
            return os.environ[variable], f"${variable}"
    import boto3

    region = boto3.Session().region_name
    if not region:
        raise UserError(
            f"no AWS region: set targets.{target}.region in function.toml, or the environment variable AWS_REGION "
            "(or AWS_DEFAULT_REGION), or `region` in your AWS profile (~/.aws/config)"
        )
    return region, "the AWS profile's `region` (~/.aws/config)"


def connect(target: str, region: str | None, endpoint_url: str | None) -> AwsContext:
    """A session for `target` whose credentials and region are checked before anything is planned."""
    import boto3
    import botocore.exceptions

    region, origin = resolve_region(region, target)
    session = boto3.Session(region_name=region)
    partition = session.get_partition_for_region(region) if _known_region(session, region) else None
    if partition is None:
        raise UserError(
            f"region {region!r} (from {origin}) is not an AWS region; "
            f"for example: {', '.join(session.get_available_regions('sts')[:6])}"
        )
    if session.get_credentials() is None:
        raise UserError(
            "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
            "(a profile in ~/.aws/credentials), or run where an instance role provides them"
        )
    context = AwsContext(session, region, endpoint_url, "", partition, target)
    with aws_errors(context, "check the credentials (sts get-caller-identity)"):
        try:
            context.account = context.client("sts").get_caller_identity()["Account"]
        except botocore.exceptions.NoCredentialsError as exc:
            raise UserError(f"no usable AWS credentials: {exc}") from exc
    return context


def _known_region(session: Any, region: str) -> bool:
    return any(
        region in session.get_available_regions("sts", partition) for partition in session.get_available_partitions()
    )


def error_code(exc: Any) -> str:
    """The error code AWS answered with (`ResourceNotFoundException`, `NoSuchBucket`, `404`, ...), or ""."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def if_exists(call: Callable[[], T], *absent: str | Callable[[ClientError], bool]) -> T | None:
    """`call()`, or None when AWS says the resource is absent (a code or a test in `absent`): gone is an answer."""
    import botocore.exceptions

    try:
        return call()  # a boto3 call answers a dict: a delete tells "was there" by `is not None`
    except botocore.exceptions.ClientError as exc:
        code = error_code(exc)
        if any(code == a if isinstance(a, str) else a(exc) for a in absent):
            return None
        raise


@contextmanager
def aws_errors(context: AwsContext, action: str) -> Iterator[None]:
    """Turn botocore's exceptions into one precise `UserError`: what was being done, and what to change."""
    import botocore.exceptions

    where = f"region {context.region}" + (f" at {context.endpoint_url}" if context.endpoint_url else "")
    try:
        yield
    except botocore.exceptions.ClientError as exc:
        code, message = error_code(exc), str(exc.response.get("Error", {}).get("Message", exc))
        if code in CREDENTIAL_CODES:
            hint = "the AWS credentials were refused: check AWS_ACCESS_KEY_ID / AWS_PROFILE and that they are current"
        elif code in QUOTA_CODES or any(m.lower() in message.lower() for m in QUOTA_MESSAGES):
            hint = "an AWS quota or limit stopped it: lower the setting or request an increase in Service Quotas"
        elif code in ("AccessDenied", "AccessDeniedException", "UnauthorizedOperation"):
            hint = "the credentials lack a permission this deploy needs"
        else:
            hint = "nothing was rolled back: fix the cause and run the same command again to resume"
        raise UserError(f"{action} failed in {where}: {code}: {message}\n{hint}") from exc
    except botocore.exceptions.NoCredentialsError as exc:
        raise UserError(f"{action}: no AWS credentials ({exc}); set AWS_ACCESS_KEY_ID or AWS_PROFILE") from exc
    except (botocore.exceptions.EndpointConnectionError, botocore.exceptions.ConnectTimeoutError) as exc:
        raise UserError(
            f"{action}: cannot reach AWS in {where} ({exc}); check the region and endpoint_url / AWS_ENDPOINT_URL"
        ) from exc


def tags(function: str, bundle_digest: str, target: str) -> dict[str, str]:
    """The tags on every resource a deploy creates: which function, which bundle, which target."""
    return {TAG_FUNCTION: function, TAG_BUNDLE: bundle_digest, TAG_TARGET: target}


def tag_list(values: dict[str, str], key: str = "Key", value: str = "Value") -> list[dict[str, str]]:
    return [{key: k, value: v} for k, v in sorted(values.items())]


def policy(*statements: dict[str, Any]) -> dict[str, Any]:
    """An IAM policy document; actions are sorted so a document read back compares equal."""
    body = []
    for statement in statements:
        entry = {"Effect": "Allow", **statement}
        if isinstance(entry.get("Action"), list):
            entry["Action"] = sorted(entry["Action"])
        body.append(entry)
    return {"Version": "2012-10-17", "Statement": body}


def subset(actual: Any, wanted: Any) -> Any:
    """`actual` cut down to the keys `wanted` has (recursively), for comparing with what AWS fills in."""
    if isinstance(actual, dict) and isinstance(wanted, dict):
        return {k: subset(actual[k], wanted[k]) for k in wanted if k in actual}
    if isinstance(actual, list) and isinstance(wanted, list) and len(actual) == len(wanted):
        return [subset(a, w) for a, w in zip(actual, wanted, strict=True)]
    return actual


def trust_policy(service: str) -> dict[str, Any]:
    return policy({"Principal": {"Service": service}, "Action": "sts:AssumeRole"})


@dataclass(frozen=True)
class Resource:
    kind: str  # a `Driver` key, e.g. "sqs-queue"
    name: str
    settings: dict[str, Any]


@dataclass(frozen=True)
class Change:
    resource: Resource
    action: str  # create | update | none
    fields: tuple[str, ...] = ()  # the settings that differ, for an update

    def describe(self) -> str:
        if self.action == "update":
            return ", ".join(f"{name} → {_short(self.resource.settings[name])}" for name in self.fields)
        if self.action == "create":
            return ", ".join(f"{k}={_short(v)}" for k, v in self.resource.settings.items() if k != "tags")
        return ""


def _short(value: Any, limit: int = 48) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Driver(Protocol):
    def read(self, context: AwsContext, resource: Resource) -> dict[str, Any] | None: ...
    def create(self, context: AwsContext, resource: Resource) -> None: ...
    def update(self, context: AwsContext, resource: Resource, fields: tuple[str, ...]) -> None: ...
    def delete(self, context: AwsContext, name: str) -> bool: ...  # False when it was already gone


@dataclass(frozen=True)
class AwsPlan:
    target: str
    function: str
    context: AwsContext
    changes: tuple[Change, ...]
    removals: tuple[Resource, ...]  # superseded resources (old endpoint configs, models), deleted after the switch
    state_dir: Path
    bundle_digest: str
    url: str
    drivers: dict[str, Driver]

    @property
    def no_changes(self) -> bool:
        return not self.removals and all(change.action == "none" for change in self.changes)

    @property
    def where(self) -> str:
        return self.context.region

    def rows(self) -> list[tuple[str, str, str, str]]:
        """(action, kind, name, what changes) for `pkg deploy --plan`."""
        rows = [(c.action, c.resource.kind, c.resource.name, c.describe()) for c in self.changes]
        return rows + [("delete", r.kind, r.name, "superseded") for r in self.removals]


@dataclass(frozen=True)
class AwsDeployment:
    """The contents of `build/NAME/TARGET/state.json`: where the function lives and how the last apply ended."""

    target: str
    function: str
    region: str
    endpoint_url: str | None
    account: str
    url: str
    bundle_digest: str
    resources: list[list[str]]  # [kind, name] in creation order, for destroy
    outcome: str  # applied | failed
    failed_step: str = ""
    updated_at: float = 0.0
    changed: int = 0
    planned: int = 0  # resources the last plan named (changed or not)

    def summary(self) -> list[tuple[str, str]]:
        return [
            ("url", self.url or "-"),
            ("region", f"{self.region} (account {self.account})"),
            ("bundle", self.bundle_digest),
            ("changed", f"{self.changed} of {self.planned} resources"),
        ]

    def next_step(self, function_dir: Path) -> str:
        return f'try it: pkg invoke {function_dir} "Hello!" --target {self.target}'


def plan_changes(context: AwsContext, drivers: dict[str, Driver], desired: list[Resource]) -> tuple[Change, ...]:
    changes = []
    for resource in desired:
        with aws_errors(context, f"read {resource.kind} {resource.name}"):
            current = drivers[resource.kind].read(context, resource)
        if current is None:
            changes.append(Change(resource, "create"))
            continue
        differing = tuple(name for name, value in resource.settings.items() if current.get(name) != value)
        changes.append(Change(resource, "update" if differing else "none", differing))
    return tuple(changes)


def apply_plan(plan: AwsPlan) -> AwsDeployment:
    """Make each change in order. A failure records the step in state.json and raises; the next `apply`
    plans again from what exists, so it resumes, and `destroy` removes whatever was created."""
    resources = [[c.resource.kind, c.resource.name] for c in plan.changes]
    deployment = AwsDeployment(
        target=plan.target, function=plan.function, region=plan.context.region, endpoint_url=plan.context.endpoint_url,
        account=plan.context.account, url=plan.url, bundle_digest=plan.bundle_digest, resources=resources,
        outcome="failed", updated_at=time.time(),
    )  # fmt: skip
    changed = 0
    for change in plan.changes:
        if change.action == "none":
            continue
        driver, resource = plan.drivers[change.resource.kind], change.resource
        step = f"{change.action} {resource.kind} {resource.name}"
        if change.action == "create":
            _run_step(plan, deployment, step, partial(driver.create, plan.context, resource))
        else:
            _run_step(plan, deployment, step, partial(driver.update, plan.context, resource, change.fields))
        changed += 1
    for stale in plan.removals:
        step = f"delete {stale.kind} {stale.name}"
        _run_step(plan, deployment, step, partial(plan.drivers[stale.kind].delete, plan.context, stale.name))
        changed += 1
    final = AwsDeployment(
        **{
            **asdict(deployment),
            "outcome": "applied",
            "updated_at": time.time(),
            "changed": changed,
            "planned": len(plan.changes),
        }
    )
    save_state(plan.state_dir, final)
    return final


def _run_step(plan: AwsPlan, deployment: AwsDeployment, step: str, action: Callable[[], Any]) -> None:
    try:
        with aws_errors(plan.context, step):
            action()
    except UserError as exc:
        save_state(plan.state_dir, AwsDeployment(**{**asdict(deployment), "failed_step": step}))
        raise UserError(
            f"{exc}\nthe deploy stopped at: {step}; `pkg deploy` resumes from there, `pkg destroy` removes what exists"
        ) from exc


def destroy_resources(context: AwsContext, drivers: dict[str, Driver], resources: list[Resource]) -> list[str]:
    """Delete each resource once, dependents first (`drivers` lists kinds in creation order); returns the
    `kind name` of each that existed. Kinds without a driver go with their parent (an image with its repository)."""
    order = {kind: index for index, kind in enumerate(drivers)}
    unique = {(r.kind, r.name): r for r in resources if r.kind in order}
    deleted = []
    for resource in sorted(unique.values(), key=lambda r: order[r.kind], reverse=True):
        with aws_errors(context, f"delete {resource.kind} {resource.name}"):
            if drivers[resource.kind].delete(context, resource.name):
                deleted.append(f"{resource.kind} {resource.name}")
    return deleted


def save_state(directory: Path, deployment: AwsDeployment) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    temporary = directory / "state.json.tmp"
    temporary.write_text(json.dumps(asdict(deployment), indent=2) + "\n")
    temporary.replace(directory / "state.json")


def load_state(directory: Path) -> AwsDeployment | None:
    try:
        return AwsDeployment(**json.loads((directory / "state.json").read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as exc:
        raise UserError(f"{directory / 'state.json'} is corrupt ({exc}); delete it and deploy again") from exc


def wait_until(check: Callable[[], str | None], what: str, timeout: float, poll: float = 2.0) -> None:
    """Poll `check` (None = done, else the current state) until done; a state naming a failure raises."""
    deadline = time.monotonic() + timeout
    while True:
        state = check()
        if state is None:
            return
        if time.monotonic() > deadline:
            raise UserError(f"{what} is still {state} after {timeout:.0f} s; run the same command again to resume")
        time.sleep(poll)
