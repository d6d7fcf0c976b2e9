# The edge target as a Greengrass v2 component: the bundle (a zip in the function's bucket) unpacked on the
# device and served by the onnxfn runtime. The AWS provider has no Greengrass v2 resource; the Cloud Control
# provider (awscc) has.

terraform {
  required_version = ">= 1.5"
  required_providers {
    awscc = {
      source  = "hashicorp/awscc"
      version = ">= 1.0"
    }
  }
}

locals {
  recipe = {
    RecipeFormatVersion = "2020-01-25"
    ComponentName       = var.component_name
    ComponentVersion    = var.component_version
    ComponentType       = "aws.greengrass.generic"
    ComponentPublisher  = "onnxfn"
    Manifests = [{
      Platform  = { os = "linux" }
      Artifacts = [{ Uri = var.bundle_uri, Unarchive = "ZIP" }]
      Lifecycle = {
        Run = join(" ", concat(
          ["python3", "-m", "runtime", "serve", "{artifacts:decompressedPath}/bundle", "--host", "0.0.0.0", "--port", tostring(var.port)],
          var.server_flags,
        ))
      }
    }]
  }
}

resource "awscc_greengrassv2_component_version" "this" {
  inline_recipe = jsonencode(local.recipe)
  tags          = var.tags
}
