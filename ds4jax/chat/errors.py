"""The one client-error type every protocol raises and renders in its own shape."""

from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A client error: Anthropic renders `{"type":"error","error":{"type","message"}}`, OpenAI
    `{"error":{"message","type","param","code"}}`. `param` is the JSON path of the field at
    fault (`messages[0].content`), when one is."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        fields: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.error_type = error_type
        self.param = param
        #: OpenAI's `code` (`context_length_exceeded`: what agents test to compact a history)
        self.code = code
        #: more of the error object in both shapes (a too-long prompt's token counts)
        self.fields = fields or {}

    def with_message(self, message: str) -> RequestError:
        """The same error (status, type, param) saying `message` instead."""
        self.message = message
        self.args = (message,)
        return self

    def body(self) -> dict[str, Any]:
        error = {"type": self.error_type, "message": self.message, **self.fields}
        return {"type": "error", "error": error}


def field_error(where: str, what: str) -> RequestError:
    """`where: what`, with `where` as the error's `param`."""
    return RequestError(f"{where}: {what}", param=where)
