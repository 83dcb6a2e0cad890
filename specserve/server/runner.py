"""uvicorn's server with a shutdown that lets the engine end every response first."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

import uvicorn


class DrainingServer(uvicorn.Server):
    """On SIGINT/SIGTERM: the engine first finishes (or aborts, after --shutdown-timeout) every
    request in flight, while new connections are still accepted and answered 503 (so a load
    balancer's health check sees the server going away); then uvicorn's own shutdown, which finds
    no response left to cut off by cancelling its task. A second Ctrl-C stops waiting at once."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets: Any = None) -> None:
        drain = asyncio.ensure_future(self._drain())
        while not drain.done() and not self.force_exit:
            await asyncio.wait({drain}, timeout=0.1)
        if not drain.done():
            drain.cancel()
        await super().shutdown(sockets)
