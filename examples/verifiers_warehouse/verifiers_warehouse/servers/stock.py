"""The `check_stock` tool: one MCP server for every episode of a run (a shared toolset),
each call answered from the calling episode's own stock (its state)."""

import verifiers.v1 as vf


class WarehouseState(vf.State):
    """An episode's hidden stock: boxes per item."""

    stock: dict[str, int] = {}


class StockToolset(vf.Toolset[vf.SharedToolsetConfig, WarehouseState]):
    TOOL_PREFIX = None  # advertised as plain `check_stock`, the name the prompt shows

    @vf.tool
    async def check_stock(self, item: str) -> str:
        """Count the boxes of an item in the warehouse."""
        stock = self.state.stock
        if item not in stock:
            return f"error: no item {item!r}; items: {', '.join(sorted(stock))}"
        return str(stock[item])


if __name__ == "__main__":
    StockToolset.run()
