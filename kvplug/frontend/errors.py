"""OpenAI-style error bodies: ``{"error": {"message", "type", "code"}}``."""

from __future__ import annotations

import json

from aiohttp import web


class ApiError(Exception):
    """A client-visible failure with its HTTP status and OpenAI error ``type``/``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code if code is not None else str(status)
        self.param = param
        self.headers: dict[str, str] = {}  # e.g. the decision id of a request that failed
        # the request's body was not (wholly) read: the connection cannot carry another request
        self.close_connection = False

    def body(self) -> dict:
        return error_body(self.message, self.type, self.code, self.param)

    def payload(self) -> bytes:
        """The answer's body: the OpenAI error JSON."""
        return json.dumps(self.body()).encode()

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        resp = web.Response(
            status=self.status,
            body=self.payload(),
            content_type="application/json",
            headers={**self.headers, **(headers or {})} or None,
        )
        if self.close_connection:
            resp.force_close()
        return resp


def error_body(message: str, type_: str, code: str | int | None, param: str | None = None) -> dict:
    err: dict = {"message": message, "type": type_, "code": code}
    if param is not None:
        err["param"] = param
    return {"error": err}


def bad_request(message: str, code: str = "invalid_request", param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", code, param)
