"""Messages <-> token ids for multi-turn agents: the one place a chat format lives.

Model turns are never rendered from text: their sampled token ids are kept as they are. Only
new non-model messages (the first user message, tool results) are rendered, each exactly once,
and appended. The tiny tokenizers' format (no chat template):

    conversation start   <bos>
    user / system        the content's tokens
    tool                 <result> CONTENT </result>
    assistant            the sampled tokens (ending with <eos>, the end-of-turn token)

A model with a real chat template needs its own `ChatFormat` with the same three methods
(rendering only the new messages each turn); this repository has only the tiny one.
"""

from __future__ import annotations

import numpy as np

TOOL_RESULT = "<result> {content} </result>"
"""How a tool's answer is shown to the model."""


def render_tool_result(tokenizer, content: str) -> np.ndarray:
    return encode(tokenizer, TOOL_RESULT.format(content=content))


def encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)


class ChatFormat:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.bos = tokenizer.bos_token_id

    def render(self, messages: list[dict[str, str]], start: bool) -> np.ndarray:
        """Token ids of new non-assistant messages; `start` prepends the conversation start."""
        parts = [np.array([self.bos], dtype=np.int32)] if start else []
        for msg in messages:
            role, content = msg["role"], msg["content"]
            if role == "tool":
                parts.append(render_tool_result(self.tokenizer, content))
            elif role in ("user", "system"):
                parts.append(encode(self.tokenizer, content))
            else:
                raise ValueError(f"cannot render a {role!r} message: model turns keep their tokens")
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)

    def prompt_messages(self, prompt_ids: np.ndarray) -> list[dict[str, str]]:
        """The task prompt as messages: `render(prompt_messages(ids), start=True)` gives `ids`."""
        ids = np.asarray(prompt_ids)
        if ids.size and ids[0] == self.bos:
            ids = ids[1:]
        return [{"role": "user", "content": self.text(ids)}]

    def text(self, ids: np.ndarray) -> str:
        """A model turn as text (special tokens such as <eos> left out), for parsing only."""
        return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)
