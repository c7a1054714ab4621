"""One session of a training run, around the roles: each part owns one concern.

`run/context.py`'s `RunContext` holds them for the loop in `run/loop.py`:

- `Activity`: what the trainer's thread is doing now (the watchdog reports it);
- `EngineLink`: the trainer's side of the engine (start, revive, weight syncs);
- `RunClock`: this session's start, `max_time_s`, and the step it began at;
- `BatchWaiter`: the wait for the next batch, under its deadlines;
- `PipelineStatus`: what every stage is doing, for the watchdog and error messages.

The ledger of group outcomes belongs to the buffer (`learning/coordinator/ledger.py`).
A resumed run is a new session of the same run.
"""


class RunAborted(RuntimeError):
    """The run cannot continue (a fatal reward error, an engine that will not come back,
    every group dropped)."""
