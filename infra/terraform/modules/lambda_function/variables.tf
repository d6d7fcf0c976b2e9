variable "function_name" {
  description = "The function's name (function.toml `name`)."
  type        = string
}

variable "package_type" {
  description = "Image (the container image, bundle inside) or Zip (code from the bucket, bundle fetched at init)."
  type        = string
  default     = "Image"
}

variable "image_uri" {
  description = "REPOSITORY_URL@sha256:DIGEST of the platform manifest (Lambda does not take image indexes)."
  type        = string
  default     = null
}

variable "code_bucket" {
  description = "Zip package: the bucket holding code/SHA256.zip (the function's own bucket)."
  type        = string
  default     = null
}

variable "code_key" {
  description = "Zip package: code/SHA256.zip."
  type        = string
  default     = null
}

variable "code_hash" {
  description = "Zip package: base64 SHA-256 of the zip (Lambda's CodeSha256)."
  type        = string
  default     = null
}

variable "runtime" {
  description = "Zip package: the managed runtime."
  type        = string
  default     = "python3.12"
}

variable "handler" {
  description = "Zip package: the handler awslambdaric imports."
  type        = string
  default     = "runtime.aws_lambda.handler.handler"
}

variable "snapstart" {
  description = "SnapStart on published versions (zip packages only; no provisioned concurrency, /tmp <= 512 MB)."
  type        = bool
  default     = false
}

variable "architecture" {
  description = "x86_64 or arm64."
  type        = string
  default     = "x86_64"
}

variable "memory_mb" {
  type    = number
  default = 3008
}

variable "timeout_seconds" {
  type    = number
  default = 120
}

variable "ephemeral_storage_mb" {
  type    = number
  default = 1024
}

variable "environment" {
  description = "ONNXFN_FLAGS: the runtime's model and AWS flags."
  type        = map(string)
}

variable "reserved_concurrency" {
  type    = number
  default = null
}

variable "provisioned_concurrency" {
  type    = number
  default = 0
}

variable "url_auth" {
  description = "AWS_IAM (callers sign requests) or NONE (public)."
  type        = string
  default     = "AWS_IAM"
}

variable "batch_size" {
  type    = number
  default = 8
}

variable "batch_window_seconds" {
  type    = number
  default = 0
}

variable "max_receive_count" {
  description = "Deliveries before a message moves to the dead-letter queue."
  type        = number
  default     = 3
}

variable "max_concurrency" {
  description = "Concurrent invocations the SQS trigger may start (null: no cap)."
  type        = number
  default     = null
}

variable "log_retention_days" {
  type    = number
  default = 30
}

variable "bucket_arn" {
  description = "ARN of the function's bucket (results/ and ledger/)."
  type        = string
}

variable "tags" {
  description = "Tags: onnxfn:function, onnxfn:bundle-digest, onnxfn:target."
  type        = map(string)
}
