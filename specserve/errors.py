"""Errors a caller can act on. Each names the field (or the fix) it is about."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request parameter is invalid. `field` names it; the message says what is allowed."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
