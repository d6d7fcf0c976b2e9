# The aws-lambda target: function from the ECR image, or (package_type = "Zip") from the zip in the function's
# bucket with SnapStart on published versions; `live` alias on the newest version, streaming function URL, SQS
# queue with a dead-letter queue and the trigger reporting partial batch failures, log group, least-privilege
# role. The same resources and settings as packager/targets/aws/lambda_function.py.

terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40"
    }
  }
}

data "aws_caller_identity" "current" {}
data "aws_region" "current" {}
data "aws_partition" "current" {}

locals {
  arn_prefix = "arn:${data.aws_partition.current.partition}"
  region     = data.aws_region.current.name
  account    = data.aws_caller_identity.current.account_id
  queue_arn  = "${local.arn_prefix}:sqs:${local.region}:${local.account}:${var.function_name}-requests"
  zip        = var.package_type == "Zip"
  # A zip package's handler fetches its bundle from the bucket in the init phase.
  bundle_statements = local.zip ? [{
    Sid = "Bundle", Effect = "Allow", Action = ["s3:GetObject"], Resource = "${var.bucket_arn}/bundles/*"
  }] : []
}

resource "aws_cloudwatch_log_group" "this" {
  #checkov:skip=CKV_AWS_158:Log data is encrypted by CloudWatch; a customer KMS key adds cost and key policy.
  #checkov:skip=CKV_AWS_338:Retention is the function spec's log_retention_days, not a fixed year.
  name              = "/aws/lambda/${var.function_name}"
  retention_in_days = var.log_retention_days
  tags              = var.tags
}

resource "aws_sqs_queue" "dlq" {
  name                       = "${var.function_name}-dlq"
  message_retention_seconds  = 1209600
  visibility_timeout_seconds = 30
  sqs_managed_sse_enabled    = true
  tags                       = var.tags
}

resource "aws_sqs_queue" "requests" {
  name                       = "${var.function_name}-requests"
  message_retention_seconds  = 345600
  visibility_timeout_seconds = min(6 * var.timeout_seconds, 43200)
  sqs_managed_sse_enabled    = true
  redrive_policy = jsonencode({
    deadLetterTargetArn = aws_sqs_queue.dlq.arn
    maxReceiveCount     = var.max_receive_count
  })
  tags = var.tags
}

resource "aws_iam_role" "this" {
  name = "onnxfn-${var.function_name}-lambda"
  assume_role_policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{ Effect = "Allow", Principal = { Service = "lambda.amazonaws.com" }, Action = "sts:AssumeRole" }]
  })
  tags = var.tags
}

# What the function does, written out: its logs, its queue, its bucket's results and ledger, reply queues.
resource "aws_iam_role_policy" "this" {
  name = "onnxfn"
  role = aws_iam_role.this.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = concat([
      {
        Sid      = "Logs", Effect = "Allow", Action = ["logs:CreateLogStream", "logs:PutLogEvents"]
        Resource = "${aws_cloudwatch_log_group.this.arn}:*"
      },
      {
        Sid      = "ConsumeRequests", Effect = "Allow"
        Action   = ["sqs:ChangeMessageVisibility", "sqs:DeleteMessage", "sqs:GetQueueAttributes", "sqs:ReceiveMessage"]
        Resource = aws_sqs_queue.requests.arn
      },
      {
        Sid      = "Replies", Effect = "Allow", Action = ["sqs:SendMessage"]
        Resource = "${local.arn_prefix}:sqs:${local.region}:${local.account}:onnxfn-reply-*"
      },
      {
        Sid      = "Results", Effect = "Allow", Action = ["s3:GetObject", "s3:PutObject"]
        Resource = ["${var.bucket_arn}/results/*", "${var.bucket_arn}/ledger/*"]
      },
      {
        Sid       = "ResultsListing", Effect = "Allow", Action = ["s3:ListBucket"], Resource = var.bucket_arn
        Condition = { StringLike = { "s3:prefix" = ["results/*", "ledger/*"] } }
      },
    ], local.bundle_statements)
  })
}

resource "aws_lambda_function" "this" {
  #checkov:skip=CKV_AWS_50:X-Ray tracing needs xray:PutTraceSegments; the runtime exports its own metrics.
  #checkov:skip=CKV_AWS_116:Invoked synchronously (URL) and by SQS, whose dead-letter queue is the redrive policy.
  #checkov:skip=CKV_AWS_117:Reaches only AWS APIs; a VPC would add NAT cost and cold-start time.
  #checkov:skip=CKV_AWS_173:The environment holds runtime flags, no secrets; Lambda encrypts it at rest.
  #checkov:skip=CKV_AWS_272:The image is pulled by digest; a zip is content-addressed and pinned by source_code_hash.
  #checkov:skip=CKV_AWS_115:Reserved concurrency is the spec's reserved_concurrency (unset: the account pool).
  function_name                  = var.function_name
  role                           = aws_iam_role.this.arn
  package_type                   = var.package_type
  image_uri                      = local.zip ? null : var.image_uri
  s3_bucket                      = local.zip ? var.code_bucket : null
  s3_key                         = local.zip ? var.code_key : null
  source_code_hash               = local.zip ? var.code_hash : null
  runtime                        = local.zip ? var.runtime : null
  handler                        = local.zip ? var.handler : null
  architectures                  = [var.architecture]
  memory_size                    = var.memory_mb
  timeout                        = var.timeout_seconds
  reserved_concurrent_executions = var.reserved_concurrency
  publish                        = true
  tags                           = var.tags

  ephemeral_storage {
    size = var.ephemeral_storage_mb
  }

  environment {
    variables = var.environment
  }

  dynamic "image_config" {
    for_each = local.zip ? [] : [["lambda"]]
    content {
      command = image_config.value
    }
  }

  # SnapStart: each published version's init phase runs once and cold starts resume from its snapshot.
  dynamic "snap_start" {
    for_each = var.snapstart ? ["PublishedVersions"] : []
    content {
      apply_on = snap_start.value
    }
  }

  depends_on = [aws_cloudwatch_log_group.this, aws_iam_role_policy.this]
}

resource "aws_lambda_alias" "live" {
  name             = "live"
  function_name    = aws_lambda_function.this.function_name
  function_version = aws_lambda_function.this.version
}

resource "aws_lambda_function_url" "this" {
  function_name      = aws_lambda_function.this.function_name
  qualifier          = aws_lambda_alias.live.name
  authorization_type = var.url_auth
  invoke_mode        = "RESPONSE_STREAM"
}

resource "aws_lambda_permission" "public_url" {
  count                  = var.url_auth == "NONE" ? 1 : 0
  statement_id           = "onnxfn-public-function-url"
  action                 = "lambda:InvokeFunctionUrl"
  function_name          = aws_lambda_function.this.function_name
  qualifier              = aws_lambda_alias.live.name
  principal              = "*"
  function_url_auth_type = "NONE"
}

resource "aws_lambda_event_source_mapping" "requests" {
  event_source_arn                   = aws_sqs_queue.requests.arn
  function_name                      = aws_lambda_alias.live.arn
  batch_size                         = var.batch_size
  maximum_batching_window_in_seconds = var.batch_window_seconds
  function_response_types            = ["ReportBatchItemFailures"]

  dynamic "scaling_config" {
    for_each = var.max_concurrency == null ? [] : [var.max_concurrency]
    content {
      maximum_concurrency = scaling_config.value
    }
  }
}

resource "aws_lambda_provisioned_concurrency_config" "this" {
  count                             = var.provisioned_concurrency > 0 ? 1 : 0
  function_name                     = aws_lambda_function.this.function_name
  qualifier                         = aws_lambda_alias.live.name
  provisioned_concurrent_executions = var.provisioned_concurrency
}
