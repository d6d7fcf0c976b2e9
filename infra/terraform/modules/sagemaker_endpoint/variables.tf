variable "function_name" {
  description = "The function's name (function.toml `name`)."
  type        = string
}

variable "endpoint_name" {
  description = "The endpoint's name (the function name, '_' as '-')."
  type        = string
}

variable "image_uri" {
  description = "REPOSITORY_URL@sha256:DIGEST of the linux/amd64 manifest."
  type        = string
}

variable "repository_arn" {
  type = string
}

variable "model_data_url" {
  description = "s3:// URI of the Neuron-compiled model.tar.gz (ml.inf2); null on GPU instances."
  type        = string
  default     = null
}

variable "environment" {
  type    = map(string)
  default = {}
}

variable "instance_type" {
  description = "ml.g5.*, ml.g6.*, ml.g6e.* (GPU) or ml.inf2.* (Inferentia2)."
  type        = string
}

variable "mode" {
  description = "realtime or async (requests and replies in S3; allows min_instances = 0)."
  type        = string
  default     = "realtime"
}

variable "min_instances" {
  type    = number
  default = 1
}

variable "max_instances" {
  type    = number
  default = 2
}

variable "scaling_metric" {
  description = "invocations, concurrency (per instance) or backlog (async queue size per instance)."
  type        = string
  default     = "invocations"
}

variable "scaling_target" {
  type    = number
  default = 8
}

variable "scale_in_cooldown_seconds" {
  type    = number
  default = 300
}

variable "scale_out_cooldown_seconds" {
  type    = number
  default = 60
}

variable "max_concurrent_invocations" {
  description = "Per instance, async mode."
  type        = number
  default     = 4
}

variable "startup_timeout_seconds" {
  type    = number
  default = 600
}

variable "log_retention_days" {
  type    = number
  default = 30
}

variable "bucket" {
  description = "Name of the function's bucket (async-in/, async-out/, async-failures/, neuron/)."
  type        = string
}

variable "bucket_arn" {
  type = string
}

variable "tags" {
  description = "Tags: onnxfn:function, onnxfn:bundle-digest, onnxfn:target."
  type        = map(string)
}
