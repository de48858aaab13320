"""The engine loop thread survives what callers do to it, and a service whose loop died exits instead of hanging.

Found by the soak: a pull cancelled while its page write waited on the loop cancelled the write's future, the
loop's ``set_result`` on it raised, and the thread ended; every later request of that decode service hung.
"""

from __future__ import annotations

import asyncio
import threading

import pytest


@pytest.fixture(scope="module")
def loop(cpu_engine_loop):
    return cpu_engine_loop


def test_a_call_cancelled_before_it_ran_is_skipped_and_the_loop_lives_on(loop):
    gate, ran = threading.Event(), []
    busy = loop.call(gate.wait)  # holds the loop thread until released
    cancelled = loop.call(lambda: ran.append("cancelled call"))
    assert cancelled.cancel()
    gate.set()
    busy.result(timeout=10)
    assert loop.call(lambda: 42).result(timeout=10) == 42
    assert ran == [] and loop.is_alive()


def test_a_failing_command_is_logged_and_the_loop_lives_on(loop):
    loop.abort("no-such-request")  # unknown ids are ignored
    loop._post(lambda: 1 / 0)  # any command that raises
    assert loop.call(lambda: "still here").result(timeout=10) == "still here"
    assert loop.is_alive()


def test_a_service_whose_engine_loop_died_stops_serving_and_raises():
    from svc_common.grpc_server import build_server, start_and_wait

    alive = threading.Event()
    alive.set()

    async def scenario():
        server = build_server(1 << 20)
        task = asyncio.ensure_future(start_and_wait(server, ["test.Service"], "test", "127.0.0.1", 0,
                                                    alive=alive.is_set))
        await asyncio.sleep(0.5)
        assert not task.done()  # serving while the loop lives
        alive.clear()  # the engine loop thread ends
        with pytest.raises(RuntimeError, match="engine loop thread died"):
            await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
