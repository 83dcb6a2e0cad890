"""uvicorn's server with a shutdown that lets the engine end every response first."""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import uvicorn


class DrainingServer(uvicorn.Server):
    """On SIGINT/SIGTERM: stop accepting connections, let the engine finish (or abort, after
    --shutdown-timeout) every request in flight, then uvicorn's own shutdown, which then finds no
    response left to cut off by cancelling its task."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self._drain = drain

    async def shutdown(self, sockets: Any = None) -> None:
        for listener in self.servers:
            listener.close()
        await self._drain()
        await super().shutdown(sockets)
