"""vLLM as the training engine (`engine.type: vllm`).

asyncgrpo launches (or attaches to) vLLM's OpenAI server and drives it through
vLLM's own routes: token-in/token-out generation with per-token weight versions,
pause/resume, and the four-step weight update. Nothing here imports vllm: the
server runs in its own environment (`engine.vllm_python`). The one piece that
runs inside vLLM, `worker_plugin/asyncgrpo_vllm_worker.py`, is loaded by vLLM's
workers as a top-level module and imports only vllm, torch and safetensors.
The trainer's side of the boundary, `VLLMBackend`, is `asyncgrpo.inference.backend.vllm`.
"""
