"""The multi-turn tool-use agent: generate, run the tool it called, show the result, repeat.

    prompt -> model turn --(a call)--> tool result (mask 0) -> model turn -> ... -> answer
                         \\-(no call)--> done: reward on the whole completion

Each model turn continues the token ids of everything before it (TrajectoryBuilder), with at
most min(task.max_new_tokens, tokens left) new tokens and its own seed (RolloutTask.seed(turn)).
The rollout ends at an answer, after `max_turns` model turns, or when the next turn (or a tool
result plus one model token) would not fit into `max_total_tokens`.
"""

from __future__ import annotations

from actors.chat import ChatFormat
from actors.engine import LLMClient
from actors.rollout import Finish, RewardFn, Rollout, RolloutTask, score
from actors.tools import ToolRegistry, parse_call
from actors.trajectory import TrajectoryBuilder


class ToolAgent:
    def __init__(self, reward_fn: RewardFn, chat: ChatFormat, tools: ToolRegistry,
                 max_turns: int, max_total_tokens: int) -> None:
        self.reward_fn = reward_fn
        self.chat = chat
        self.tools = tools
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens

    async def run(self, task: RolloutTask, llm: LLMClient) -> Rollout:
        traj = TrajectoryBuilder(task.prompt_ids, self.max_total_tokens)
        finish = await self.episode(task, llm, traj)
        reward, scores = await score(self.reward_fn, task.meta,
                                     traj.context()[len(task.prompt_ids):])
        rollout = traj.rollout(reward, finish)
        rollout.scores = scores
        return rollout

    async def episode(self, task: RolloutTask, llm: LLMClient, traj: TrajectoryBuilder) -> Finish:
        history = self.chat.prompt_messages(task.prompt_ids)
        while True:
            c = await llm.generate(traj.context(), min(task.max_new_tokens, traj.remaining),
                                   task.temperature, task.seed(traj.turns))
            traj.add_model(c)
            text = self.chat.text(c.token_ids)
            history.append({"role": "assistant", "content": text})
            call = parse_call(text)
            if call is None:  # an answer, unless the turn was cut at its token limit
                return Finish.ANSWER if c.finish_reason == "stop" else Finish.MAX_TOKENS
            if traj.turns >= self.max_turns:
                return Finish.MAX_TURNS
            tool = {"role": "tool", "content": await self.tools.call(call)}
            result = self.chat.follow(history, c.token_ids, [tool])
            history.append(tool)
            if len(result) >= traj.remaining:  # no room for the result and one more model token
                return Finish.MAX_TOKENS
            traj.add_environment(result)
