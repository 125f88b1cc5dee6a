"""The gateway service: llmserve's OpenAI-compatible HTTP/SSE/WebSocket edge (``python -m
services.gateway``). Pure logic lives in ``protocol.py`` / ``openai_schema.py`` / ``errors.py``;
``streams.py`` and ``generation.py`` hold the per-request bus conversation; ``app.py`` the
routes."""
