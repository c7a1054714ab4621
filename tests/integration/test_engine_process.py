"""An engine process's life when a restart runs in another thread, on the tiny model.

Replicas restart in the background (`backend/replicas.py`), on a worker thread
that a closing run cannot interrupt. A close in the middle of such a restart
must win: the restart may not start a child after it, or the child outlives the
run (a CI run found a vLLM server left behind this way). And a restart whose
child never becomes ready stops that child instead of leaving it running.
"""

from __future__ import annotations

import threading

import pytest

from asyncgrpo.base.config import EmbeddedEngineConfig
from asyncgrpo.base.engine_errors import EngineStartError
from asyncgrpo.inference.engine.process import EngineProcess
from asyncgrpo.testing import engine_children


@pytest.fixture
def engine(tiny_model_dir):
    cfg = EmbeddedEngineConfig(model=str(tiny_model_dir), dtype="float32", num_threads=1)
    with EngineProcess(cfg) as proc:  # started; closed at the end
        proc.wait_ready(120)
        yield proc


def test_a_close_during_a_restart_in_another_thread_leaves_no_engine_running(engine):
    between, closed = threading.Event(), threading.Event()
    stop = engine.stop

    def stop_then_wait_for_the_close(*args, **kwargs) -> None:
        stop(*args, **kwargs)
        if threading.current_thread().name == "restart":  # between its stop and its start
            between.set()
            closed.wait(30)

    engine.stop = stop_then_wait_for_the_close
    failures: list[BaseException] = []

    def restart() -> None:
        try:
            engine.restart(60)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=restart, name="restart")
    thread.start()
    assert between.wait(30)
    engine.close()
    closed.set()
    thread.join(60)
    assert not thread.is_alive()
    assert len(failures) == 1 and isinstance(failures[0], EngineStartError), failures
    assert "closed" in str(failures[0])
    assert engine_children() == [] and not engine.alive()


@pytest.mark.heavy
def test_a_restart_that_is_not_ready_in_time_stops_its_child(engine):
    with pytest.raises(EngineStartError, match="not ready"):
        engine.restart(0.01)  # the tiny model loads in seconds, not in 10 ms
    assert engine_children() == [] and not engine.alive()
    engine.restart(120)  # and it can still be restarted properly
    assert engine.alive() and len(engine_children()) == 1
