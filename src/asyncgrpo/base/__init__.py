"""What both sides of asyncgrpo share, and nothing else: the layer every other folder stands on.

- `config/`: the typed, validated recipe (a leaf: validating one imports no torch);
- `models`: model names to local directories (the shipped SmolLM2, a path, a cached hub id);
- `hardware`: CPU and thread probes; `ports`, `loop_thread`: small process utilities;
- `engine_errors`: how a call to an engine fails, as both sides see it;
- `staleness`: the version rules as pure functions;
- `episode`: the record of one agent episode that the gateway writes and the trainer reads.
"""
