"""The queue frontend: the SQS long-poll worker, and the envelope and result contract every queue shares."""
