"""`specdec serve`: an OpenAI-compatible server with continuous batching (specdec.serve.server)."""
