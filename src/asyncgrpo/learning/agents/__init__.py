"""Multi-turn agents on the learning side: the rollout API, the episode runner, tools.

- `rollout_api`: what a user's `async def rollout(task, llm)` receives and returns
  (`LLM`, `Result`, the failure types that are never reward 0).
- `runner`: runs one episode against the gateway and classifies how it ended.
- `tools`: Python functions as tools (`tool_schema`, `ToolBox`).

The gateway that records an episode's calls and turns them into token-exact samples
lives on the inference side (`inference/server/trajectory.py`, tool-call parsing in
`inference/server/toolcalls.py`); the records both sides share are in
`base/episode.py`.
"""

from asyncgrpo.base.episode import BranchSequence, EpisodeMetrics, EpisodeResult, StopReason
from asyncgrpo.learning.agents.rollout_api import LLM, Result, RewardError, reward_scope
from asyncgrpo.learning.agents.tools import ToolBox, ToolResult, tool_schema

__all__ = [
    "LLM",
    "BranchSequence",
    "EpisodeMetrics",
    "EpisodeResult",
    "Result",
    "RewardError",
    "StopReason",
    "ToolBox",
    "ToolResult",
    "reward_scope",
    "tool_schema",
]
