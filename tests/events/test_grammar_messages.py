"""Issue 37 rows 2 and 3 as SQS messages: a grammar refusal is a stored 400 and a rejection, never a retry.

The queue parses and compiles with the HTTP handlers' code (api/grammar_compile.py), so an unusable
grammar ends as it does over HTTP: its 400 is written to `reply_to` and the ledger, and the message is
reported failed for the DLQ instead of going back to the queue as a crash would.
"""

from __future__ import annotations

import json

from runtime.aws_lambda.sqs_batch import process_sqs_batch
from tests.events.conftest import EngineUnderTest, Queues, chat_envelope, queue_handler
from tests.events.test_lambda_handler import failures, lambda_event, receive_all, s3_reply


def test_unusable_grammars_get_stored_400s_and_a_good_one_its_answer(
    queues: Queues, engine_under_test: EngineUnderTest
) -> None:
    huge = "start: " + " | ".join(f"/w{i}/" for i in range(20_000))  # 199 KB, over the 128 KiB limit
    cases = {
        "fuel": ({"guided_regex": "((a{100}){100}){100}"}, "guided_regex", "ran out of fuel"),
        "huge": ({"guided_grammar": huge}, "guided_grammar", "at most 131072 are allowed"),
        "tools": (
            {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]},
            "tools",
            "at most 128 are allowed",
        ),
    }
    sent = {queues.send(chat_envelope(name, s3_reply(queues, name), **case[0])): name for name, case in cases.items()}
    good = queues.send(chat_envelope("good", s3_reply(queues, "good"), guided_choice=["yes", "no"]))
    records = lambda_event(queues, receive_all(queues, len(sent) + 1))["Records"]

    response = process_sqs_batch(records, queue_handler(engine_under_test, queues))

    assert failures(response) == set(sent)  # rejected, for the DLQ: none was left to be retried
    for message_id, name in sent.items():
        _, param, fragment = cases[name]
        result = queues.result(f"out/{name}.json")
        assert result is not None and result.status == 400, name
        error = result.body["error"]
        assert error["param"] == param and fragment in error["message"], error
        assert "panic" not in error["message"] and "backtrace" not in error["message"]
        record = queues.s3.get_object(Bucket=queues.bucket, Key=f"ledger/errors/{message_id}.json")
        assert json.loads(record["Body"].read())["error"]["param"] == param
    answered = queues.result("out/good.json")
    assert good not in failures(response) and answered is not None and answered.status == 200
    assert answered.body["choices"][0]["message"]["content"] in ("yes", "no")
