"""The multi-turn tool-use agent: generate, run the tool it called, show the result, repeat.

    prompt -> model turn --(a call)--> tool result (mask 0) -> model turn -> ... -> answer
                         \\-(no call)--> done: reward on the whole completion

Each model turn continues the token ids of everything before it (TrajectoryBuilder), with at
most min(task.max_new_tokens, tokens left) new tokens and its own seed (RolloutTask.seed(turn)).
The rollout ends at an answer, after `max_turns` model turns, or when the next turn (or a tool
result plus one model token) would not fit into `max_total_tokens`.

Calls are read by the same named parser as the OpenAI endpoint's (`actors.agent.tool_parser`:
tether `<call> NAME ARG </call>` | hermes `<tool_call>{json}</tool_call>`) and results are
rendered by the same chat format, so one trained model works in both. A turn that does not
parse gets an error message as its tool result (and is counted in `tool_parse_errors`).
`tool_defs`, if given, are rendered by the chat template with every message (the task's
prompts must have been rendered with them).
"""

from __future__ import annotations

from tasks.chat import ChatFormat, Tools
from actors.engines.base import LLMClient
from actors.rollout import Finish, RewardFn, Rollout, RolloutTask, score
from actors.agents.tool_parsers import ParseFailure, TetherParser, ToolParser, argument_of
from actors.agents.tools import CallError, ToolCall, ToolRegistry
from actors.agents.trajectory import TrajectoryBuilder


class ToolAgent:
    def __init__(self, reward_fn: RewardFn, chat: ChatFormat, tools: ToolRegistry,
                 max_turns: int, max_total_tokens: int, parser: ToolParser | None = None,
                 tool_defs: Tools = None) -> None:
        self.reward_fn = reward_fn
        self.parser = parser or TetherParser()
        self.tool_defs = tool_defs
        self.chat = chat
        self.tools = tools
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens

    async def run(self, task: RolloutTask, llm: LLMClient) -> Rollout:
        traj = TrajectoryBuilder(task.prompt_ids, self.max_total_tokens)
        errors: list[str] = []
        finish = await self.episode(task, llm, traj, errors)
        reward, scores = await score(self.reward_fn, task.meta,
                                     traj.context()[len(task.prompt_ids):])
        r = traj.rollout(reward, finish)
        r.scores = scores
        r.tool_parse_errors = len(errors)
        return r

    async def episode(self, task: RolloutTask, llm: LLMClient, traj: TrajectoryBuilder,
                      parse_errors: list[str] | None = None) -> Finish:
        """Runs the turns; appends the message of every turn that did not parse to `parse_errors`."""
        parse_errors = [] if parse_errors is None else parse_errors
        history = self.chat.prompt_messages(task.prompt_ids, self.tool_defs)
        while True:
            c = await llm.generate(traj.context(), min(task.max_new_tokens, traj.remaining),
                                   task.temperature, task.seed(traj.turns))
            traj.add_model(c)
            text = self.chat.text(c.token_ids)
            history.append({"role": "assistant", "content": text})
            parsed = self.parser.parse(text)
            if isinstance(parsed, ParseFailure):
                parse_errors.append(parsed.message)
                calls = [CallError(parsed.message)]
            else:
                calls = [ToolCall(f.name, argument_of(f)) for f in parsed.calls]
            if not calls:  # an answer, unless the turn was cut at its token limit
                return Finish.ANSWER if c.finish_reason == "stop" else Finish.MAX_TOKENS
            if traj.turns >= self.max_turns:
                return Finish.MAX_TURNS
            results = [{"role": "tool", "content": await self.tools.call(x)} for x in calls]
            result = self.chat.follow(history, c.token_ids, results, self.tool_defs)
            history.extend(results)
            if len(result) >= traj.remaining:  # no room for the result and one more model token
                return Finish.MAX_TOKENS
            traj.add_environment(result)
