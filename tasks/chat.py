"""Messages <-> token ids for multi-turn agents: the one place a chat format lives.

Model turns are never rendered from text: their sampled token ids are kept as they are. Only
new non-model messages (the first user message, tool results) are rendered, each exactly once,
and appended. Two formats share one interface (`ChatFormat`); `make_chat_format` picks one:

* `TinyChat`, for tokenizers without a chat template (the tiny word-level ones):

      conversation start   <bos>
      user / system        the content's tokens
      tool                 <result> CONTENT </result>
      assistant            the sampled tokens (ending with <eos>, the end-of-turn token)

* `TemplateChat`, for any HF tokenizer with a `chat_template`. The new messages of a turn are
  the string difference of two renderings, tokenized alone:

      before = template(history)                                  (history ends with a model turn)
      after  = template(history + new, add_generation_prompt=True)
      ids    = encode(rest of the model turn's closing + after[len(before):])     (mask 0)

  `after` must start with `before` (else the template is not prefix-stable and we refuse it,
  naming the tokenizer). A template closes an assistant message with more than the model
  samples (ChatML: `<|im_end|>\\n` after the content, while the model stops at `<|im_end|>`);
  what the template appends beyond the sampled end-of-turn token (`\\n`; all of `<|im_end|>\\n`
  if the turn was cut at the token limit) goes in front of the new messages, also mask 0.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from models.tiny import render_tool_result

Message = dict[str, str]
"""{"role": "system" | "user" | "assistant" | "tool", "content": str}."""

Tools = list[dict] | None
"""OpenAI tool definitions (`{"type": "function", "function": {...}}`) for the chat template's
`tools` argument, or None. The tiny format has no template and ignores them."""

def encode(tokenizer, text: str) -> np.ndarray:
    return np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int32)


class ChatFormat(Protocol):
    tokenizer: object

    def start(self, messages: list[Message], tools: Tools = None) -> np.ndarray:
        """Token ids of a conversation's first messages, ready for the first model turn."""

    def follow(self, history: list[Message], last_turn: np.ndarray,
               new: list[Message], tools: Tools = None) -> np.ndarray:
        """Token ids that come after the model turn `last_turn` (sampled ids; its text is
        `history[-1]`) when the non-assistant messages `new` are added: the rest of the
        template's closing of that turn, the new messages, the next generation prompt."""

    def prompt_messages(self, prompt_ids: np.ndarray, tools: Tools = None) -> list[Message]:
        """The task prompt as messages: `start(prompt_messages(ids, tools), tools)` gives `ids`."""

    def text(self, ids: np.ndarray) -> str:
        """A model turn as text (special tokens left out), for parsing and for clients."""


def make_chat_format(tokenizer) -> ChatFormat:
    """`TemplateChat` if the tokenizer has a chat template, else the tiny format."""
    if getattr(tokenizer, "chat_template", None):
        return TemplateChat(tokenizer)
    return TinyChat(tokenizer)


def _decode_text(tokenizer, ids: np.ndarray) -> str:
    return tokenizer.decode([int(t) for t in ids], skip_special_tokens=True)


class TinyChat:
    """The tiny tokenizers' format (no chat template); see the module docstring."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.bos = tokenizer.bos_token_id

    def start(self, messages: list[Message], tools: Tools = None) -> np.ndarray:
        return np.concatenate([np.array([self.bos], dtype=np.int32), self._render(messages)])

    def follow(self, history: list[Message], last_turn: np.ndarray,
               new: list[Message], tools: Tools = None) -> np.ndarray:
        return self._render(new)

    def _render(self, messages: list[Message]) -> np.ndarray:
        parts = [np.zeros(0, dtype=np.int32)]
        for msg in messages:
            role, content = msg["role"], msg["content"]
            if role == "tool":
                parts.append(render_tool_result(self.tokenizer, content))
            elif role in ("user", "system"):
                parts.append(encode(self.tokenizer, content))
            else:
                raise ValueError(f"cannot render a {role!r} message: model turns keep their tokens")
        return np.concatenate(parts)

    def prompt_messages(self, prompt_ids: np.ndarray, tools: Tools = None) -> list[Message]:
        ids = np.asarray(prompt_ids)
        if ids.size and ids[0] == self.bos:
            ids = ids[1:]
        return [{"role": "user", "content": self.text(ids)}]

    def text(self, ids: np.ndarray) -> str:
        return _decode_text(self.tokenizer, ids)


SENTINEL = "\x00TETHER-CONTENT\x00"
"""Placeholder content used to find where a template puts a message's text."""


class TemplateChat:
    """Any HF tokenizer with a `chat_template`; see the module docstring."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        user = [{"role": "user", "content": "x"}]
        prompt = self._render(user, generation_prompt=True)
        answered = self._render([*user, {"role": "assistant", "content": SENTINEL}], False)
        if not answered.startswith(prompt + SENTINEL):
            raise ValueError(f"the chat template of tokenizer {self.name!r} does not render an "
                             "assistant message as generation prompt + content + closing")
        self.closing = answered[len(prompt) + len(SENTINEL):]
        """What the template writes after an assistant message's content (ChatML: `<|im_end|>\\n`)."""

    def _render(self, messages: list[Message], generation_prompt: bool, tools: Tools = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def _encode(self, text: str) -> np.ndarray:
        return encode(self.tokenizer, text)

    def _not_prefix_stable(self, what: str) -> ValueError:
        return ValueError(f"the chat template of tokenizer {self.name!r} is not prefix-stable: "
                          f"{what}; multi-turn rollouts need a template whose rendering of a "
                          "conversation starts with its rendering of every earlier turn")

    def start(self, messages: list[Message], tools: Tools = None) -> np.ndarray:
        self._check_roles(messages)
        return self._encode(self._render(messages, generation_prompt=True, tools=tools))

    def follow(self, history: list[Message], last_turn: np.ndarray,
               new: list[Message], tools: Tools = None) -> np.ndarray:
        self._check_roles(new)
        if not history or history[-1]["role"] != "assistant":
            raise ValueError("follow() continues after a model turn: history must end with it")
        before = self._render(history, generation_prompt=False, tools=tools)
        asked = self._render(history[:-1], generation_prompt=True, tools=tools)
        if before != asked + history[-1]["content"] + self.closing:
            raise self._not_prefix_stable("the last model turn is not rendered as the "
                                          "generation prompt followed by its content")
        after = self._render([*history, *new], generation_prompt=True, tools=tools)
        if not after.startswith(before):
            raise self._not_prefix_stable(f"adding {[m['role'] for m in new]} messages changes "
                                          "the rendering of the conversation so far")
        return self._encode(self._closing_rest(last_turn) + after[len(before):])

    def _closing_rest(self, last_turn: np.ndarray) -> str:
        """The template's closing of a model turn minus what the model sampled of it: its
        end-of-turn token (if the turn ended with one that the closing starts with)."""
        if len(last_turn) and int(last_turn[-1]) in self.tokenizer.all_special_ids:
            stop = self.tokenizer.decode([int(last_turn[-1])])
            if self.closing.startswith(stop):
                return self.closing[len(stop):]
        return self.closing

    @staticmethod
    def _check_roles(messages: list[Message]) -> None:
        for msg in messages:
            if msg["role"] == "assistant":
                raise ValueError("cannot render an 'assistant' message: model turns keep their tokens")

    def prompt_messages(self, prompt_ids: np.ndarray, tools: Tools = None) -> list[Message]:
        """The one user message whose rendering (with `tools`) is the prompt (checked token for
        token; its content may not hold special tokens, e.g. a second message's markers)."""
        text = self.tokenizer.decode([int(t) for t in prompt_ids], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
        head, _, tail = self._render([{"role": "user", "content": SENTINEL}], True,
                                     tools).partition(SENTINEL)
        content = text[len(head):len(text) - len(tail)]
        messages = [{"role": "user", "content": content}]
        specials = any(t in content for t in self.tokenizer.all_special_tokens)
        if specials or not (text.startswith(head) and text.endswith(tail)) or \
                self.start(messages, tools).tolist() != np.asarray(prompt_ids).tolist():
            raise ValueError(f"the task prompt is not one user message under the chat template "
                             f"of {self.name!r}; agents that start from messages need such prompts")
        return messages

    def text(self, ids: np.ndarray) -> str:
        return _decode_text(self.tokenizer, ids)
