"""Queue invocation: the SQS worker, the Lambda handler, and the envelope and result contract they share."""
