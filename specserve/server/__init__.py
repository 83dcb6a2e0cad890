"""OpenAI-compatible HTTP server: `specserve serve`, or `create_app(llm, ...)` for the ASGI app.

Imported lazily, so that `specserve generate` and friends do not pay for (or need) FastAPI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from specserve.server.app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
