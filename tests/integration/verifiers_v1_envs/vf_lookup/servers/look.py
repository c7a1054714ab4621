"""The `look` tool, served over MCP in a process of its own for the whole run (a shared
toolset): every episode's calls reach it, each with that episode's state."""

import verifiers.v1 as vf


class LookupState(vf.State):
    """What an episode's task wrote for its tool calls to read."""

    values: dict[str, str] = {}


class LookupToolset(vf.Toolset[vf.SharedToolsetConfig, LookupState]):
    TOOL_PREFIX = None  # the tool is advertised as plain `look`

    @vf.tool
    async def look(self, key: str) -> str:
        """Look a key up."""
        return self.state.values.get(key, f"nothing under {key}")


if __name__ == "__main__":
    LookupToolset.run()
