"""Real chat templates (tasks/chat.py TemplateChat) with a locally built ChatML tokenizer: only
new messages are rendered, model turns keep their sampled ids, the template's end-of-turn
closing is added with mask 0, and templates that are not prefix-stable are refused."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from actors.rollout import RolloutTask
from tasks.chat import SENTINEL, TemplateChat, TinyChat, make_chat_format
from actors.engines.base import Completion
from actors.agents.openai.example import calculator_agent
from actors.agents.openai.server import OpenAIAgent, OpenAIEndpoint
from actors.agents.tool_agent import ToolAgent
from actors.agents.tools import Calculator, ToolRegistry
from models.tiny import build_tokenizer

CHATML = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou add numbers.<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A Qwen2.5-like ChatML template: default system message, tool results as user turns, and
`<|im_end|>\\n` after every message (the model samples only the `<|im_end|>`)."""


def chatml_tokenizer(template: str = CHATML, name: str = "local-chatml"):
    """A byte-level BPE tokenizer trained here on a few lines, with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["system user assistant tool <call> calc 1 2 3 + 4 5 6 </call> <tool_response>",
              "</tool_response> You add numbers. What is 12 + 30 ? 4 2\n"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>"], name_or_path=name)
    fast.chat_template = template
    return fast


TOK = chatml_tokenizer()
CHAT = TemplateChat(TOK)
END = TOK.convert_tokens_to_ids("<|im_end|>")
QUESTION = [{"role": "user", "content": "What is 12 + 30 ?"}]
CALL, ANSWER = "<call> calc 12 + 30 </call>", "4 2"


def ids(text: str) -> np.ndarray:
    return np.asarray(TOK.encode(text, add_special_tokens=False), dtype=np.int32)


class ScriptedLLM:
    """Answers each generate() with the next scripted turn + <|im_end|> (or cut at the limit)."""

    def __init__(self, turns: list[str]) -> None:
        self.turns = turns
        self.contexts: list[np.ndarray] = []

    async def generate(self, prompt_ids, max_new_tokens, temperature, seed) -> Completion:
        k = len(self.contexts)
        self.contexts.append(np.asarray(prompt_ids).copy())
        tok = np.concatenate([ids(self.turns[min(k, len(self.turns) - 1)]), [END]])
        tok = tok[:max_new_tokens].astype(np.int32)
        return Completion(token_ids=tok, logprobs=np.full(len(tok), -0.5, np.float32),
                          versions=np.zeros(len(tok), np.int32),
                          finish_reason="stop" if tok[-1] == END else "length")


def task(max_new_tokens: int = 40) -> RolloutTask:
    prompt = CHAT.start(QUESTION)
    return RolloutTask(prompt_id=0, sample_index=0, prompt_ids=prompt, meta={},
                       max_new_tokens=max_new_tokens, temperature=1.0, run_seed=0)


def agent(max_turns: int = 3) -> ToolAgent:
    return ToolAgent(lambda meta, ids: 0.0, CHAT, ToolRegistry([Calculator()], 5.0), max_turns, 200)


def segments(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, mask value) of the runs of equal mask values."""
    edges = [0, *(np.nonzero(np.diff(mask))[0] + 1), len(mask)]
    return [(a, b, int(mask[a])) for a, b in zip(edges, edges[1:])]


def test_format_is_chosen_by_the_tokenizer():
    assert isinstance(make_chat_format(TOK), TemplateChat)
    assert isinstance(make_chat_format(build_tokenizer()), TinyChat)
    assert CHAT.closing == "<|im_end|>\n"


def test_prompt_is_the_templates_own_rendering_and_round_trips():
    prompt = CHAT.start(QUESTION)
    want = TOK.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    assert prompt.tolist() == list(want)
    assert CHAT.prompt_messages(prompt) == QUESTION
    two = CHAT.start([*QUESTION, {"role": "user", "content": "again"}])
    with pytest.raises(ValueError, match="not one user message"):
        CHAT.prompt_messages(two)


def test_multi_turn_renders_only_new_messages_and_keeps_model_turns():
    llm = ScriptedLLM([CALL, ANSWER])
    r = asyncio.run(agent().run(task(), llm))
    assert r.finish == "answer"
    runs = segments(r.loss_mask)
    assert [v for _, _, v in runs] == [1, 0, 1]
    (a0, a1, _), (t0, t1, _), (b0, b1, _) = runs
    # model turns are exactly the sampled ids, <|im_end|> included
    np.testing.assert_array_equal(r.completion_ids[a0:a1], np.append(ids(CALL), END))
    np.testing.assert_array_equal(r.completion_ids[b0:b1], np.append(ids(ANSWER), END))
    # the mask-0 part: the rest of the closing ("\n"), the tool message, the generation prompt
    assert TOK.decode(r.completion_ids[t0:t1]) == (
        "\n<|im_start|>user\n<tool_response>\n4 2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    # the second turn continued the exact ids so far (nothing re-tokenized)
    np.testing.assert_array_equal(llm.contexts[1],
                                  np.concatenate([task().prompt_ids, r.completion_ids[:t1]]))
    # and the whole sequence is the template's rendering of the conversation
    conversation = [*QUESTION, {"role": "assistant", "content": CALL},
                    {"role": "tool", "content": "4 2"}, {"role": "assistant", "content": ANSWER}]
    full = TOK.apply_chat_template(conversation, tokenize=False)
    text = TOK.decode(np.concatenate([task().prompt_ids, r.completion_ids]))
    assert text + "\n" == full


def test_a_turn_cut_at_the_token_limit_gets_the_whole_closing_with_mask_0():
    cut_at = len(ids(CALL))  # the call fits, its <|im_end|> does not
    r = asyncio.run(agent().run(task(max_new_tokens=cut_at), ScriptedLLM([CALL, ANSWER])))
    (_, a1, _), (t0, t1, _), *_ = segments(r.loss_mask)
    assert r.completion_ids[a1 - 1] != END
    assert TOK.decode(r.completion_ids[t0:t1]).startswith("<|im_end|>\n<|im_start|>user\n")


def test_a_template_that_is_not_prefix_stable_is_refused_naming_the_tokenizer():
    # renders only the last two messages: adding a message rewrites the earlier rendering
    window = CHATML.replace("{% for m in messages %}", "{% for m in messages[-2:] %}")
    chat = TemplateChat(chatml_tokenizer(window, name="window-chatml"))
    history = [*QUESTION, {"role": "assistant", "content": CALL}]
    with pytest.raises(ValueError, match="'window-chatml' is not prefix-stable"):
        chat.follow(history, np.append(ids(CALL), END), [{"role": "tool", "content": "4 2"}])
    # the agent fails the rollout with that error (the learner counts it as agent_error)
    t = RolloutTask(prompt_id=0, sample_index=0, prompt_ids=chat.start(QUESTION), meta={},
                    max_new_tokens=40, temperature=1.0, run_seed=0)
    bad = ToolAgent(lambda meta, ids: 0.0, chat, ToolRegistry([Calculator()], 5.0), 3, 200)
    with pytest.raises(ValueError, match="not prefix-stable"):
        asyncio.run(bad.run(t, ScriptedLLM([CALL, ANSWER])))
    # a template that drops the content of assistant messages is refused when built
    with pytest.raises(ValueError, match="does not render an assistant message"):
        TemplateChat(chatml_tokenizer(CHATML.replace("{{ m['content'] }}<|im_end|>", "<|im_end|>"),
                                      name="no-content"))
    assert SENTINEL not in CHAT.closing


def test_openai_client_agent_through_a_chat_template_matches_the_tool_agent():
    endpoint = OpenAIEndpoint(CHAT, 0, max_turns=3, max_total_tokens=200)
    via = OpenAIAgent(endpoint, calculator_agent, lambda meta, ids: 0.0)

    async def both():
        http = await via.run(task(), ScriptedLLM([CALL, ANSWER]))
        await endpoint.close_server()
        return http, await agent().run(task(), ScriptedLLM([CALL, ANSWER]))

    http, direct = asyncio.run(both())
    for field in ("completion_ids", "logprobs", "versions", "loss_mask"):
        np.testing.assert_array_equal(getattr(http, field), getattr(direct, field))
    assert http.finish == direct.finish == "answer"
