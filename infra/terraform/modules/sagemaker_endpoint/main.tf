# The aws-sagemaker target: model (image, and the Neuron artifact on ml.inf2), endpoint config, endpoint,
# Application Auto Scaling between min and max instances with target tracking, and for an async endpoint
# scaled to zero the step policy and alarm that wake it. The same resources and settings as
# packager/targets/aws/sagemaker.py.

terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40"
    }
  }
}

locals {
  resource_id = "endpoint/${var.endpoint_name}/variant/AllTraffic"
  wakes       = var.mode == "async" && var.min_instances == 0
  predefined_metrics = {
    invocations = "SageMakerVariantInvocationsPerInstance"
    concurrency = "SageMakerVariantConcurrentRequestsPerModelHighResolution"
  }
}

resource "aws_cloudwatch_log_group" "this" {
  #checkov:skip=CKV_AWS_158:Log data is encrypted by CloudWatch; a customer KMS key adds cost and key policy.
  #checkov:skip=CKV_AWS_338:Retention is the function spec's log_retention_days, not a fixed year.
  name              = "/aws/sagemaker/Endpoints/${var.endpoint_name}"
  retention_in_days = var.log_retention_days
  tags              = var.tags
}

resource "aws_iam_role" "this" {
  name = "onnxfn-${var.function_name}-sagemaker"
  assume_role_policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{ Effect = "Allow", Principal = { Service = "sagemaker.amazonaws.com" }, Action = "sts:AssumeRole" }]
  })
  tags = var.tags
}

# What the container does: pull its image, write its logs, read requests and the model, write replies.
resource "aws_iam_role_policy" "this" {
  #checkov:skip=CKV_AWS_355:ecr:GetAuthorizationToken has no resource-level permissions: AWS only grants it on "*".
  #checkov:skip=CKV_AWS_290:ecr:GetAuthorizationToken has no resource-level permissions: AWS only grants it on "*".
  name = "onnxfn"
  role = aws_iam_role.this.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [
      { Sid = "EcrLoginHasNoResourceLevelPermissions", Effect = "Allow", Action = ["ecr:GetAuthorizationToken"], Resource = "*" },
      {
        Sid      = "PullImage", Effect = "Allow"
        Action   = ["ecr:BatchCheckLayerAvailability", "ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"]
        Resource = var.repository_arn
      },
      {
        Sid      = "Logs", Effect = "Allow"
        Action   = ["logs:CreateLogStream", "logs:DescribeLogStreams", "logs:PutLogEvents"]
        Resource = "${aws_cloudwatch_log_group.this.arn}:*"
      },
      {
        Sid      = "ReadRequestsAndModel", Effect = "Allow", Action = ["s3:GetObject"]
        Resource = ["${var.bucket_arn}/async-in/*", "${var.bucket_arn}/neuron/*"]
      },
      {
        Sid      = "WriteReplies", Effect = "Allow", Action = ["s3:PutObject"]
        Resource = ["${var.bucket_arn}/async-out/*", "${var.bucket_arn}/async-failures/*"]
      },
    ]
  })
}

# The container needs no network: SageMaker pulls the image and model and moves async payloads itself.
resource "aws_sagemaker_model" "this" {
  execution_role_arn       = aws_iam_role.this.arn
  enable_network_isolation = true
  tags                     = var.tags

  primary_container {
    image          = var.image_uri
    model_data_url = var.model_data_url
    environment    = var.environment
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_sagemaker_endpoint_configuration" "this" {
  #checkov:skip=CKV_AWS_98:GPU and Inferentia instances use NVMe instance storage, which takes no KMS key.
  name_prefix = "${var.endpoint_name}-"
  tags        = var.tags

  production_variants {
    variant_name                                      = "AllTraffic"
    model_name                                        = aws_sagemaker_model.this.name
    instance_type                                     = var.instance_type
    initial_instance_count                            = max(1, var.min_instances)
    container_startup_health_check_timeout_in_seconds = var.startup_timeout_seconds
  }

  dynamic "async_inference_config" {
    for_each = var.mode == "async" ? [1] : []
    content {
      output_config {
        s3_output_path  = "s3://${var.bucket}/async-out/"
        s3_failure_path = "s3://${var.bucket}/async-failures/"
      }
      client_config {
        max_concurrent_invocations_per_instance = var.max_concurrent_invocations
      }
    }
  }

  lifecycle {
    create_before_destroy = true
  }
}

resource "aws_sagemaker_endpoint" "this" {
  name                 = var.endpoint_name
  endpoint_config_name = aws_sagemaker_endpoint_configuration.this.name
  tags                 = var.tags
}

resource "aws_appautoscaling_target" "this" {
  service_namespace  = "sagemaker"
  resource_id        = local.resource_id
  scalable_dimension = "sagemaker:variant:DesiredInstanceCount"
  min_capacity       = var.min_instances
  max_capacity       = var.max_instances
  tags               = var.tags
  depends_on         = [aws_sagemaker_endpoint.this]
}

resource "aws_appautoscaling_policy" "tracking" {
  name               = "${var.endpoint_name}-${var.scaling_metric}"
  policy_type        = "TargetTrackingScaling"
  service_namespace  = aws_appautoscaling_target.this.service_namespace
  resource_id        = aws_appautoscaling_target.this.resource_id
  scalable_dimension = aws_appautoscaling_target.this.scalable_dimension

  target_tracking_scaling_policy_configuration {
    target_value       = var.scaling_target
    scale_in_cooldown  = var.scale_in_cooldown_seconds
    scale_out_cooldown = var.scale_out_cooldown_seconds

    dynamic "predefined_metric_specification" {
      for_each = var.scaling_metric == "backlog" ? [] : [local.predefined_metrics[var.scaling_metric]]
      content {
        predefined_metric_type = predefined_metric_specification.value
      }
    }

    dynamic "customized_metric_specification" {
      for_each = var.scaling_metric == "backlog" ? [1] : []
      content {
        metric_name = "ApproximateBacklogSizePerInstance"
        namespace   = "AWS/SageMaker"
        statistic   = "Average"
        dimensions {
          name  = "EndpointName"
          value = aws_sagemaker_endpoint.this.name
        }
      }
    }
  }
}

resource "aws_appautoscaling_policy" "wake_from_zero" {
  count              = local.wakes ? 1 : 0
  name               = "${var.endpoint_name}-wake-from-zero"
  policy_type        = "StepScaling"
  service_namespace  = aws_appautoscaling_target.this.service_namespace
  resource_id        = aws_appautoscaling_target.this.resource_id
  scalable_dimension = aws_appautoscaling_target.this.scalable_dimension

  step_scaling_policy_configuration {
    adjustment_type         = "ChangeInCapacity"
    metric_aggregation_type = "Average"
    cooldown                = var.scale_out_cooldown_seconds

    step_adjustment {
      metric_interval_lower_bound = 0
      scaling_adjustment          = 1
    }
  }
}

resource "aws_cloudwatch_metric_alarm" "backlog_without_capacity" {
  count               = local.wakes ? 1 : 0
  alarm_name          = "${var.endpoint_name}-backlog-without-capacity"
  metric_name         = "HasBacklogWithoutCapacity"
  namespace           = "AWS/SageMaker"
  statistic           = "Average"
  period              = 60
  evaluation_periods  = 1
  threshold           = 1
  comparison_operator = "GreaterThanOrEqualToThreshold"
  treat_missing_data  = "missing"
  dimensions          = { EndpointName = aws_sagemaker_endpoint.this.name }
  alarm_actions       = [aws_appautoscaling_policy.wake_from_zero[0].arn]
  tags                = var.tags
}
