output "component_arn" {
  value = awscc_greengrassv2_component_version.this.arn
}
