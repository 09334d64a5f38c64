"""An overloaded answer (the state budget cannot hold a request beside those in flight,
`Engine._check_room`) in each protocol's shape: Anthropic's 529 `overloaded_error`,
OpenAI's 503, both with `retry-after`."""

from __future__ import annotations

import asyncio
import json

from quart import Quart

from serve.app import RETRY_AFTER_S, _err


def _answer(path: str, status: int, error_type: str | None = None):
    app = Quart(__name__)

    async def go():
        async with app.test_request_context(path, method="POST"):
            resp = _err(status, "overloaded: retry shortly", error_type)
            return resp.status_code, dict(resp.headers), json.loads(await resp.get_data())

    return asyncio.run(go())


def test_anthropic_gets_529_and_openai_503_both_told_when_to_retry() -> None:
    status, headers, body = _answer("/v1/messages", 529, "overloaded_error")
    assert status == 529 and headers["retry-after"] == str(RETRY_AFTER_S)
    assert body == {"type": "error", "error": {"type": "overloaded_error",
                                               "message": "overloaded: retry shortly"}}  # fmt: skip
    for path in ("/v1/chat/completions", "/v1/responses"):
        status, headers, body = _answer(path, 529, "overloaded_error")
        assert status == 503 and headers["retry-after"] == str(RETRY_AFTER_S)
        assert body["error"]["type"] == "overloaded_error" and body["error"]["param"] is None


def test_other_errors_carry_no_retry_after() -> None:
    status, headers, _ = _answer("/v1/messages", 400)
    assert status == 400 and "retry-after" not in headers
