"""The AWS region comes from the spec, else `$AWS_REGION` (Lambda, AWS CLI v2), else boto3's own
`$AWS_DEFAULT_REGION` or profile; boto3 alone reads only the latter two (issue 39)."""

from __future__ import annotations

from pathlib import Path

import pytest

from packager.errors import UserError
from packager.targets.aws.common import connect, resolve_region


@pytest.fixture
def bare_aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """No region, no credentials, no profile files, no instance metadata: only what a test sets."""
    for variable in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_PROFILE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                     "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL"):  # fmt: skip
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return monkeypatch


def test_aws_region_alone_is_enough_and_reaches_the_session(bare_aws_env: pytest.MonkeyPatch) -> None:
    bare_aws_env.setenv("AWS_REGION", "eu-west-3")
    assert resolve_region(None, "aws-lambda") == ("eu-west-3", "$AWS_REGION")
    # Past the region check: the next thing missing is the credentials, not the region.
    with pytest.raises(UserError, match="no AWS credentials"):
        connect("aws-lambda", None, None)


def test_aws_region_wins_over_aws_default_region_and_the_spec_over_both(bare_aws_env: pytest.MonkeyPatch) -> None:
    bare_aws_env.setenv("AWS_REGION", "eu-west-3")
    bare_aws_env.setenv("AWS_DEFAULT_REGION", "us-east-2")
    assert resolve_region(None, "aws-sagemaker") == ("eu-west-3", "$AWS_REGION")
    assert resolve_region("ap-south-1", "aws-sagemaker") == ("ap-south-1", "targets.aws-sagemaker.region")
    bare_aws_env.delenv("AWS_REGION")
    assert resolve_region(None, "aws-sagemaker") == ("us-east-2", "$AWS_DEFAULT_REGION")


def test_the_profile_region_still_counts(bare_aws_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("[default]\nregion = ca-central-1\n")
    bare_aws_env.setenv("AWS_CONFIG_FILE", str(config))
    assert resolve_region(None, "greengrass")[0] == "ca-central-1"


def test_no_region_names_every_way_to_set_one(bare_aws_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError) as refused:
        resolve_region(None, "aws-lambda")
    message = str(refused.value)
    for way in ("targets.aws-lambda.region", "AWS_REGION", "AWS_DEFAULT_REGION", "~/.aws/config"):
        assert way in message, message


def test_a_wrong_region_says_where_it_came_from(bare_aws_env: pytest.MonkeyPatch) -> None:
    bare_aws_env.setenv("AWS_REGION", "us-east-7")
    with pytest.raises(UserError, match=r"region 'us-east-7' \(from \$AWS_REGION\) is not an AWS region"):
        connect("aws-lambda", None, None)
