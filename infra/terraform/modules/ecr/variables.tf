variable "name" {
  description = "Repository name, e.g. onnxfn/FUNCTION/aws-lambda."
  type        = string
}

variable "pull_service" {
  description = "Service principal allowed to pull (lambda.amazonaws.com); null for none."
  type        = string
  default     = null
}

variable "pull_source_arn" {
  description = "ARN of the function the pull grant is limited to."
  type        = string
  default     = null
}

variable "tags" {
  description = "Tags: onnxfn:function, onnxfn:bundle-digest, onnxfn:target."
  type        = map(string)
}
