"""Actors whose constructor is a coroutine (test_async_init.py)."""

from __future__ import annotations

import asyncio

import pmetal


@pmetal.remote
class Warmed:
    async def __init__(self, value: int) -> None:
        self.ready = asyncio.Event()
        # A task started by the constructor goes on in the actor's loop.
        self.warming = asyncio.ensure_future(self._warm(value))

    async def _warm(self, value: int) -> None:
        await asyncio.sleep(0)
        self.value = value
        self.ready.set()

    async def get(self) -> int:
        await self.ready.wait()
        return self.value

    def same_loop(self) -> bool:   # a sync method of an async actor runs in a thread
        return not self.warming.cancelled()


@pmetal.remote(max_concurrency=4)
class Refused:
    async def __init__(self, why: str) -> None:
        await asyncio.sleep(0)
        raise ValueError(why)

    async def never(self) -> None:
        return None
