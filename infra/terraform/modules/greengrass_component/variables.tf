variable "component_name" {
  description = "e.g. dev.onnxfn.FUNCTION"
  type        = string
}

variable "component_version" {
  description = "Semantic version; a new bundle needs a new version."
  type        = string
}

variable "bundle_uri" {
  description = "s3:// URI of the zipped bundle folder."
  type        = string
}

variable "port" {
  type    = number
  default = 8080
}

variable "server_flags" {
  description = "The `python -m runtime serve` flags carrying the spec's runtime settings."
  type        = list(string)
  default     = []
}

variable "tags" {
  description = "Tags: onnxfn:function, onnxfn:bundle-digest, onnxfn:target."
  type        = map(string)
}
