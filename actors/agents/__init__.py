"""Agents: one module per kind; the OpenAI endpoint and its examples in openai/."""
