"""HTTP server for the embedded engine (OpenAI-compatible routes + RL control routes)."""

from asyncgrpo.inference.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
