"""The inference side: everything that samples tokens and takes weights in.

- `engine/`: the embedded engine (continuous batching over a preallocated KV cache);
- `server/`: its HTTP server (OpenAI-compatible and RL control routes) and the episode
  gateway that records agents' calls as token-exact samples;
- `client/`: the trainer-side client of any engine speaking those routes;
- `vllm/`: a real vLLM server driven through the same routes;
- `backend/`: starts, watches and restarts engines of either kind (one or many);
- `transport/`: weights from the trainer into an engine (shared memory, disk, HTTP);
- `adapters`, `core_share`: LoRA updates as the engine takes them; cores lent between
  the engine and the trainer.

Nothing here imports `learning/`: the two sides meet in `base/` and are joined by `run/`.
"""
