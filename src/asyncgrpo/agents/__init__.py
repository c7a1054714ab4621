"""Multi-turn agents: tool-call parsing, Python-function tools, token-exact trajectories.

- `toolcalls`: parsers per model family (`get_parser("hermes")`) turning generated
  text into OpenAI `tool_calls`; the system-message fallback for chat templates
  that do not render tools.
- `tools`: Python functions as tools (`tool_schema`, `ToolBox`).
- `trajectory`: the recorded calls of an episode → training samples on the
  engine's own token ids (`TrajectoryBuilder`, `next_prompt_ids`).
"""

from asyncgrpo.agents.toolcalls import (
    ParseResult,
    ToolCall,
    get_parser,
    inject_tools_fallback,
    register_parser,
    render_tools_fallback,
    template_renders_tools,
)
from asyncgrpo.agents.tools import ToolBox, ToolResult, tool_schema
from asyncgrpo.agents.trajectory import (
    BranchSequence,
    Call,
    ChatRenderer,
    EpisodeMetrics,
    EpisodeResult,
    StopReason,
    TrajectoryBuilder,
    build_samples,
    next_prompt_ids,
)

__all__ = [
    "Call",
    "ChatRenderer",
    "EpisodeMetrics",
    "EpisodeResult",
    "ParseResult",
    "BranchSequence",
    "StopReason",
    "ToolBox",
    "ToolCall",
    "ToolResult",
    "TrajectoryBuilder",
    "build_samples",
    "get_parser",
    "inject_tools_fallback",
    "next_prompt_ids",
    "register_parser",
    "render_tools_fallback",
    "template_renders_tools",
    "tool_schema",
]
