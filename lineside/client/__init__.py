"""Client-side helpers for a lineside server (httpx only: never imports the server or the CLI)."""

from lineside.client.prompt_stream import PromptStream

__all__ = ["PromptStream"]
