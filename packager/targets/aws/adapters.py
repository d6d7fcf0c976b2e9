"""`pkg adapter add|remove|list --target aws-lambda|aws-sagemaker`: LoRA adapters in the function's adapter store.

The store is in the bucket `pkg deploy` made for the function (`onnxfn-F-lambda-ACCOUNT-REGION`, or
`-sagemaker-`), under `adapters/F/`: `NAME.safetensors` (the converted adapter file, its sha256 in the object's
metadata too) and `index.json`, the list a starting function reads (format: runtime/adapters/s3_store.py).
`add` uploads the file, then writes the index; `remove` writes the index, then deletes the file: a function
starting meanwhile sees the adapter whole or not at all. The index names the object version it hashed (the
bucket is versioned), so replacing an adapter never pairs one upload's digest with another's bytes. Two `add`s at
the same moment race on the index (the last one written wins): add one at a time.

Nothing running changes: each new execution environment (Lambda) or instance (SageMaker) fetches and verifies the
store's adapters when it starts. `add` also gives the function's role read access to `adapters/F/*` (an inline
policy of its own, `onnxfn-adapters`, which `pkg deploy` leaves alone).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from packager.adapters.client import PreparedAdapter
from packager.errors import UserError
from packager.spec import FunctionSpec
from packager.targets.aws import common as aws
from packager.targets.aws.common import AwsContext
from packager.targets.aws.resources import bucket_name
from runtime.adapters.s3_store import (
    INDEX_NAME,
    StoredAdapter,
    index_bytes,
    parse_index,
    store_prefix,
)

LAMBDA, SAGEMAKER = "aws-lambda", "aws-sagemaker"
TARGETS = (LAMBDA, SAGEMAKER)
READ_POLICY = "onnxfn-adapters"  # the role's inline policy for the adapter store (pkg deploy's is `onnxfn`)
SHA256_METADATA = "onnxfn-sha256"


@dataclass
class AdapterStore:
    spec: FunctionSpec
    target: str
    context: AwsContext
    bucket: str
    prefix: str  # adapters/F/
    role: str

    @classmethod
    def of(cls, spec: FunctionSpec, target: str) -> AdapterStore:
        if target not in TARGETS:
            raise ValueError(target)
        settings = spec.targets.aws_lambda if target == LAMBDA else spec.targets.aws_sagemaker
        context = aws.connect(target, settings.region, settings.endpoint_url)
        role = f"onnxfn-{spec.name}-{'lambda' if target == LAMBDA else 'sagemaker'}"
        return cls(spec, target, context, bucket_name(spec.name, target, context), store_prefix(spec.name), role)

    @property
    def where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    @property
    def _s3(self) -> Any:
        return self.context.client("s3")

    def check_deployed(self) -> None:
        with aws.aws_errors(self.context, f"read the bucket {self.bucket}"):
            found = aws.if_exists(lambda: self._s3.head_bucket(Bucket=self.bucket), "404", "NoSuchBucket", "NotFound")
        if found is None:
            raise UserError(
                f"{self.spec.name} is not deployed on {self.target} in {self.context.region} (no bucket "
                f"{self.bucket}): deploy it first: pkg deploy {self.spec.directory} --target {self.target}"
            )

    def index(self) -> dict[str, StoredAdapter]:
        with aws.aws_errors(self.context, f"read {self.where}{INDEX_NAME}"):
            raw = aws.if_exists(
                lambda: self._s3.get_object(Bucket=self.bucket, Key=self.prefix + INDEX_NAME)["Body"].read(),
                "NoSuchKey",
                "404",
            )
        if raw is None:
            return {}
        try:
            return parse_index(raw)
        except (ValueError, KeyError, TypeError) as exc:
            raise UserError(
                f"{self.where}{INDEX_NAME} is not an adapter index ({exc}); remove it and add again"
            ) from exc

    def _write_index(self, adapters: dict[str, StoredAdapter]) -> None:
        with aws.aws_errors(self.context, f"write {self.where}{INDEX_NAME}"):
            self._s3.put_object(
                Bucket=self.bucket, Key=self.prefix + INDEX_NAME, Body=index_bytes(adapters),
                ContentType="application/json",
            )  # fmt: skip

    def add(self, prepared: PreparedAdapter) -> StoredAdapter:
        """Upload, then index: a function starting meanwhile sees the old index (and the old version) or the new."""
        self.check_deployed()
        hexdigest = prepared.digest.removeprefix("sha256:")
        assert hexdigest == hashlib.sha256(prepared.data).hexdigest()
        key = f"{self.prefix}{prepared.name}.safetensors"
        with aws.aws_errors(self.context, f"upload {key} to {self.bucket}"):
            put = self._s3.put_object(
                Bucket=self.bucket, Key=key, Body=prepared.data, ContentType="application/octet-stream",
                Metadata={SHA256_METADATA: hexdigest},
            )  # fmt: skip
        stored = StoredAdapter(prepared.name, key, hexdigest, len(prepared.data), put.get("VersionId") or None)
        adapters = self.index()
        adapters[prepared.name] = stored
        self._write_index(adapters)
        return stored

    def remove(self, name: str) -> StoredAdapter:
        self.check_deployed()
        adapters = self.index()
        if name not in adapters:
            have = ", ".join(sorted(adapters)) or "none"
            raise UserError(
                f"{self.spec.name} has no adapter {name!r} in {self.where} (it has: {have}); the bundle's own "
                "adapters go by removing them from function.toml and rebuilding"
            )
        stored = adapters.pop(name)
        self._write_index(adapters)
        with aws.aws_errors(self.context, f"delete {stored.key} from {self.bucket}"):
            self._s3.delete_object(Bucket=self.bucket, Key=stored.key)
        return stored

    def grant_read(self) -> bool:
        """Let the function's role read the store; False when the role does not exist (nothing to grant to)."""
        iam = self.context.client("iam")
        with aws.aws_errors(self.context, f"give the role {self.role} read access to {self.where}"):
            if aws.if_exists(lambda: iam.get_role(RoleName=self.role), "NoSuchEntity") is None:
                return False
            iam.put_role_policy(RoleName=self.role, PolicyName=READ_POLICY, PolicyDocument=json.dumps(self.policy()))
        return True

    def policy(self) -> dict[str, Any]:
        bucket = self.context.arn("s3", self.bucket, regional=False)
        return aws.policy({
            "Sid": "ReadAdapterStore", "Action": ["s3:GetObject", "s3:GetObjectVersion"],
            "Resource": f"{bucket}/{self.prefix}*",
        })  # fmt: skip


def next_start(spec: FunctionSpec, target: str) -> str:
    """What to tell the user: when the deployed function picks a change of its adapter store up."""
    if target == LAMBDA:
        name = spec.name
        return (
            "it takes effect as Lambda starts new execution environments (cold starts); running ones keep the "
            "adapters they started with until Lambda retires them (with SnapStart every restore reads the store "
            "again). To switch at once, publish a new version and point the live alias at it: "
            f'aws lambda update-function-configuration --function-name {name} --description "adapters $(date +%s)"; '
            f"aws lambda publish-version --function-name {name}; "
            f"aws lambda update-alias --function-name {name} --name live --function-version N"
        )
    return (
        "it takes effect on the instances that start from now on (scale-out, replacement, an endpoint update); "
        "running instances keep the adapters they started with. To replace them at once, update the endpoint "
        f"{spec.name.replace('_', '-')} to a copy of its endpoint config: SageMaker starts new instances, then "
        "retires the old ones"
    )


def rows(store: AdapterStore) -> list[dict[str, Any]]:
    """The store's adapters as `pkg adapter list` rows."""
    store.check_deployed()
    found = store.index()
    return [_row(store.spec, name, stored) for name, stored in sorted(found.items())]


def _row(spec: FunctionSpec, name: str, stored: StoredAdapter) -> dict[str, Any]:
    return {"id": f"{spec.name}:{name}", "name": name, "digest": f"sha256:{stored.sha256}", "bytes": stored.size,
            "bundled": False, "resident": False}  # fmt: skip
