"""Grammar-constrained decoding (xgrammar) and tool-call shaping: structured outputs and forced tool
calls in the engine, and the parsing of a model's tool-call text into OpenAI's `tool_calls`."""
