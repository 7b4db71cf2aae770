"""Errors as OpenAI's API words them: a status code and `{"error": {message, type, param, code}}`.

Every refusal the server makes goes through `APIError`, so a client sees the same body
shape for bad JSON, a limit, a wrong key or a full queue, and never a traceback.
"""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


NO_TOKENIZER = "this package has no tokenizer; send token ids"


def no_tokenizer(param: str) -> APIError:
    return bad_request(NO_TOKENIZER, param, "no_tokenizer")
