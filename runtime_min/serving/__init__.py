"""`dsneuron serve`: the OpenAI HTTP API (server.py, openai_protocol.py), the engine thread that
steps the scheduler (engine.py), DeepSeek-V4's chat format and its tool-call markup (chat.py,
dsml.py) and grammar-constrained replies (grammar.py). The top layer: nothing below imports it."""
