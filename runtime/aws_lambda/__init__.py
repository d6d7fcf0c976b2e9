"""AWS Lambda: one execution environment serving SQS batches (through the queue frontend) and HTTP events
(through the HTTP app, by mangum), with SnapStart's hooks around the engine's start-up."""
