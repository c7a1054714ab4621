"""Multi-turn agents: tool-call parsing, Python-function tools, token-exact trajectories."""
