"""The actor's OpenAI chat-completions endpoint (server, HTTP, wire format) and example agents."""
