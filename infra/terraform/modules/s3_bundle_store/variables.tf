variable "name" {
  description = "Bucket name: onnxfn-FUNCTION-TARGET-ACCOUNT-REGION."
  type        = string
}

variable "noncurrent_days" {
  description = "Days an overwritten object version is kept."
  type        = number
  default     = 30
}

variable "tags" {
  description = "Tags: onnxfn:function, onnxfn:bundle-digest, onnxfn:target."
  type        = map(string)
}
