"""HTTP events through the Lambda entry point: function URL and API Gateway events reach the HTTP server's app
(through mangum) and come back in Lambda's HTTP response format, served by the same engine as SQS batches."""

from __future__ import annotations

import base64
import json
from typing import Any

from packager.targets.aws.lambda_function import decode_http_response, function_url_event
from runtime.aws_lambda import handler as lambda_handler
from runtime.aws_lambda.handler import handler
from tests.events.conftest import LAMBDA_MODEL, LambdaContext, Queues, chat_envelope
from tests.events.test_lambda_handler import lambda_event, receive_all, s3_reply

CHAT = {
    "model": LAMBDA_MODEL,
    "messages": [{"role": "user", "content": "What is the capital of France?"}],
    "max_tokens": 8,
}


def rest_api_event(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """An API Gateway REST API (payload format 1.0) proxy event, as Lambda delivers it."""
    return {
        "resource": "/{proxy+}", "path": path, "httpMethod": "POST",
        "headers": {"Content-Type": "application/json", "Host": "abc.execute-api.us-east-1.amazonaws.com"},
        "multiValueHeaders": {"Content-Type": ["application/json"]},
        "queryStringParameters": None, "multiValueQueryStringParameters": None,
        "pathParameters": {"proxy": path.lstrip("/")}, "stageVariables": None,
        "requestContext": {"resourcePath": "/{proxy+}", "httpMethod": "POST", "path": f"/prod{path}",
                           "stage": "prod", "requestId": "r-1", "identity": {"sourceIp": "127.0.0.1"}},
        "body": json.dumps(body), "isBase64Encoded": False,
    }  # fmt: skip


def body_of(response: dict[str, Any]) -> str:
    raw = response["body"]
    return base64.b64decode(raw).decode() if response.get("isBase64Encoded") else raw


def test_a_function_url_chat_gets_the_http_servers_completion(
    aws_env: dict[str, str], lambda_environment: None
) -> None:
    response = handler(function_url_event("/v1/chat/completions", CHAT), LambdaContext())
    assert response["statusCode"] == 200
    assert response["headers"]["content-type"] == "application/json"
    completion = decode_http_response(response)
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"]["content"]
    assert completion["usage"]["completion_tokens"] <= 8
    assert completion["system_fingerprint"].startswith("fp_")


def test_a_client_mistake_is_an_openai_error_with_its_4xx_status(
    aws_env: dict[str, str], lambda_environment: None
) -> None:
    response = handler(function_url_event("/v1/chat/completions", {**CHAT, "temperature": 5}), LambdaContext())
    assert response["statusCode"] == 400
    error = json.loads(body_of(response))["error"]
    assert error["param"] == "temperature" and error["type"] == "invalid_request_error"
    missing = handler(function_url_event("/v1/nothing-here", CHAT), LambdaContext())
    assert missing["statusCode"] == 404
    assert json.loads(body_of(missing))["error"]["code"] == "not_found"
    wrong_model = handler(function_url_event("/v1/chat/completions", {**CHAT, "model": "gpt-9"}), LambdaContext())
    assert wrong_model["statusCode"] == 404
    assert json.loads(body_of(wrong_model))["error"]["param"] == "model"


def test_a_rest_api_event_and_a_buffered_stream_get_the_same_greedy_text(
    aws_env: dict[str, str], lambda_environment: None
) -> None:
    url = decode_http_response(handler(function_url_event("/v1/chat/completions", CHAT), LambdaContext()))
    expected = url["choices"][0]["message"]["content"]
    rest = handler(rest_api_event("/v1/chat/completions", CHAT), LambdaContext())
    assert rest["statusCode"] == 200
    assert json.loads(body_of(rest))["choices"][0]["message"]["content"] == expected
    streamed = handler(function_url_event("/v1/chat/completions", {**CHAT, "stream": True}), LambdaContext())
    assert streamed["statusCode"] == 200
    assert streamed["headers"]["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in body_of(streamed).splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3  # the whole stream, in one buffered body
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
    assert text == expected


def test_http_events_and_sqs_batches_share_one_engine(queues: Queues, lambda_environment: None) -> None:
    handler(function_url_event("/v1/chat/completions", CHAT), LambdaContext())
    function = lambda_handler.loaded_function()
    engine = function.engine
    served = engine.stats().tokens_out
    queues.send(chat_envelope("both", s3_reply(queues, "both")))
    assert handler(lambda_event(queues, receive_all(queues, 1)), LambdaContext()) == {"batchItemFailures": []}
    assert lambda_handler.loaded_function() is function and function.engine is engine
    assert engine.stats().tokens_out > served  # the queue's request ran on the engine the HTTP one used
    again = handler(function_url_event("/v1/chat/completions", CHAT), LambdaContext())  # the loop outlives a batch
    assert again["statusCode"] == 200
    assert function.app.state.server.engine is engine
