"""The Quart shim serving the Anthropic Messages API (lands with the server issue)."""
