"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from specserve.errors import InvalidRequestError


class APIError(Exception):
    """An error the server answers with `status` and an OpenAI-style body."""

    def __init__(
        self, status: int, message: str, *, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def invalid(cls, e: InvalidRequestError, rename: dict[str, str] | None = None) -> APIError:
        """400 for an InvalidRequestError, its field renamed to the request's own name for it."""
        field = (rename or {}).get(e.field, e.field)
        return cls(400, f"{field}: {e.message}", param=field, code="invalid_value")

    @classmethod
    def from_validation(cls, e: ValidationError) -> APIError:
        """400 for a body pydantic rejects: malformed JSON, a wrong type, a missing field."""
        err = e.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            detail = (err.get("ctx") or {}).get("error", err["msg"])
            return cls(400, f"malformed JSON body: {detail}", code="invalid_json")
        loc = [str(part) for part in err["loc"] if not _is_union_tag(part)]
        if not loc:
            return cls(400, f"request body: {err['msg']}", code="invalid_type")
        msg = err["msg"]
        if len(loc) < len(err["loc"]):  # a union: the first member's complaint would mislead
            shown = repr(err.get("input"))
            msg = f"{shown if len(shown) <= 60 else shown[:57] + '...'} is not an accepted type or value"
        return cls(400, f"{'.'.join(loc)}: {msg}", param=loc[0], code="invalid_type")


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "none"})


def _is_union_tag(part: Any) -> bool:
    """pydantic puts the union member it tried into the error location (`prompt.list[int].0`)."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
