"""The learning side: everything that turns samples into a better policy.

- `rollout/`: prompt rows to scored groups (single-turn or agent episodes), rewards,
  group advantages, the orchestrator that keeps groups coming;
- `agents/`: the rollout API user code is written against, the episode runner, tools;
- `environments/`: TRL tools and environment classes, OpenEnv servers, verifiers;
- `coordinator/`: the buffer between producer and consumer, and its ledger;
- `trainer/`: log-probs, losses, packing, optimizer steps, ranks, LoRA, checkpoints;
- `metrics/`: step rows, sinks, plots, the progress display;
- `tasks/`: the built-in tasks and their reward functions.

Nothing here imports `inference/`: an engine is reached through a client that
`run/` passes in.
"""
