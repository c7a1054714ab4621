"""asyncgrpo: asynchronous GRPO-family reinforcement learning for language models.

Generation and training overlap: an inference engine keeps sampling while the
trainer consumes scored groups and pushes fresh weights back. Every generated
token records the policy version that sampled it, so the loss can correct for
the lag. See the README for the two commands that get you started.
"""

__version__ = "0.1.0"

from asyncgrpo.api import AsyncGRPOConfig, AsyncGRPOTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "RunAborted", "__version__"]


def __getattr__(name: str):
    """`asyncgrpo.RunAborted` (what a stopped run raises), imported on first use: the
    engine and worker processes import this package and need none of the run."""
    if name == "RunAborted":
        from asyncgrpo.run.session import RunAborted

        return RunAborted
    raise AttributeError(f"module 'asyncgrpo' has no attribute {name!r}")
