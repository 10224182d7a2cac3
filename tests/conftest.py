"""Shared fixtures: every async test body runs on asyncio's loop and on uvloop."""

from __future__ import annotations

import asyncio

import pytest

from mlfabric.runtime import loop as loops

LOOP_KINDS = ("asyncio", "uvloop")

@pytest.fixture(params=LOOP_KINDS)
def loop_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def run_async(loop_kind: str):
    """run_async(coro, timeout=30): run on the test's loop kind, bounded in time.

    An exception that reaches the loop's exception handler (a callback that
    raised, a task that failed unobserved) fails the test.
    """

    def run(coro, timeout: float = 30.0):
        errors: list[dict] = []

        async def main():
            asyncio.get_running_loop().set_exception_handler(
                lambda loop, context: errors.append(context)
            )
            return await asyncio.wait_for(coro, timeout)

        result = loops.run(main(), kind=loop_kind)
        assert not errors, f"unhandled exception in the {loop_kind} loop: {errors}"
        return result

    return run
