"""AWS targets: Lambda and SageMaker endpoints, the resources they share, and the same as Terraform."""
