"""A training run: the one place where the inference and learning sides are joined.

- `loop`: `asyncgrpo train`, the whole asynchronous algorithm on one screen;
- `build`: a `RunConfig` (and optional user objects) to a ready `RunContext`;
- `context`: the run's parts held together for the loop (resume, checkpoint, close);
- `session/`: one concern each (engine link and weight syncs, clock, batch wait,
  activity, pipeline status); `watchdog`, `evaluation`;
- `cluster/`: Ray placement of engines and trainer ranks;
- `export`: a run's weights as a Hugging Face model or PEFT adapter.
"""
