# The function's bucket (bundles, queue results and the ledger, async requests and replies, the Neuron
# artifact): versioned, encrypted, closed to the public, old versions expiring, as `pkg deploy` makes it.

terraform {
  required_version = ">= 1.5"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.40"
    }
  }
}

resource "aws_s3_bucket" "this" {
  #checkov:skip=CKV_AWS_18:Access logs need a second bucket; requests are already logged by the function itself.
  #checkov:skip=CKV_AWS_144:Results and artifacts are reproducible; cross-region replication doubles storage.
  #checkov:skip=CKV_AWS_145:AES256 (SSE-S3) encrypts at rest; a customer KMS key adds cost and key policy.
  #checkov:skip=CKV2_AWS_62:Nothing consumes bucket events: replies are polled by request id.
  bucket        = var.name
  force_destroy = true
  tags          = var.tags
}

resource "aws_s3_bucket_versioning" "this" {
  bucket = aws_s3_bucket.this.id
  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm = "AES256"
    }
  }
}

resource "aws_s3_bucket_public_access_block" "this" {
  bucket                  = aws_s3_bucket.this.id
  block_public_acls       = true
  ignore_public_acls      = true
  block_public_policy     = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id
  rule {
    id     = "expire-old-versions"
    status = "Enabled"
    filter {
      prefix = ""
    }
    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_days
    }
    abort_incomplete_multipart_upload {
      days_after_initiation = 7
    }
  }
}
