"""`vf_talk`'s taskset without its `Env`: verifiers runs it as `SingleAgentEnv`."""

from vf_talk import TalkTaskset

__all__ = ["TalkTaskset"]
