# The function's image repository: the same settings `pkg deploy` gives it (packager/targets/aws/resources.py).

terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40"
    }
  }
}

resource "aws_ecr_repository" "this" {
  #checkov:skip=CKV_AWS_136:AES256 (SSE-S3) encrypts at rest; a customer KMS key adds cost and key policy to manage.
  name                 = var.name
  image_tag_mutability = "IMMUTABLE"
  force_delete         = true
  tags                 = var.tags

  image_scanning_configuration {
    scan_on_push = true
  }

  encryption_configuration {
    encryption_type = "AES256"
  }
}

# Only the service that runs the image, on behalf of this function, may pull it (Lambda needs this grant).
resource "aws_ecr_repository_policy" "pull" {
  count      = var.pull_service == null ? 0 : 1
  repository = aws_ecr_repository.this.name
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "LambdaPullForThisFunction"
      Effect    = "Allow"
      Principal = { Service = var.pull_service }
      Action    = ["ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"]
      Condition = { StringLike = { "aws:sourceArn" = "${var.pull_source_arn}*" } }
    }]
  })
}
