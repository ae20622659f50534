"""Built-in reward functions, used by import path like any other (`task.reward`):

    tasks.builtin_rewards:math_verify       LaTeX / numeric answer equals the label (math-verify)
    tasks.builtin_rewards:gsm8k             the number after the last '####' equals the label
    tasks.builtin_rewards:exact_match       the stripped completion equals str(label)
    tasks.builtin_rewards:regex_format      the completion matches reward_kwargs `pattern`
    tasks.builtin_rewards:length_penalty    1 - tokens / reward_kwargs `max_tokens` (>= 0)
    tasks.builtin_rewards:correct_and_short the last number equals the label, shorter is better

All follow the documented signature (completion, completion_ids, label, metadata, **kwargs);
see tasks/rewards.py. Importing this module is cheap: math-verify loads on first use.
"""

from __future__ import annotations

import re

from tasks.gsm8k import final_number, same_number

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def math_verify(completion: str, completion_ids, label, metadata, **_) -> float:
    """1.0 if math-verify finds the completion's answer (e.g. `\\boxed{}` or a final number)
    equal to the label (`$\\frac{1}{2}$`, `0.5`, ...), else 0.0. math-verify's own timeouts use
    signals, which work here: rewards run in the main thread of their worker process."""
    from math_verify import parse, verify

    gold = parse(label if isinstance(label, str) and "$" in label else f"${label}$")
    return float(bool(gold) and verify(gold, parse(completion)))


def gsm8k(completion: str, completion_ids, label, metadata, **_) -> float:
    """1.0 if the number after the last '####' (else the last number) equals the label."""
    got = final_number(completion)
    gold = final_number(str(label))
    return float(got is not None and gold is not None and same_number(got, gold))


def exact_match(completion: str, completion_ids, label, metadata, **_) -> float:
    return float(completion.strip() == str(label).strip())


def regex_format(completion: str, completion_ids, label, metadata, pattern: str = r"####\s*-?\d",
                 **_) -> float:
    """1.0 if `pattern` (re.search) matches the completion: a format reward."""
    return float(re.search(pattern, completion) is not None)


def length_penalty(completion: str, completion_ids, label, metadata, max_tokens: int = 64,
                   **_) -> float:
    """1 at zero tokens, falling linearly to 0 at `max_tokens`."""
    return max(0.0, 1.0 - len(completion_ids) / max_tokens)


def correct_and_short(completion: str, completion_ids, label, metadata, max_tokens: int = 32,
                      weight: float = 0.5, **_) -> dict[str, float]:
    """correct × (1 - weight × min(1, tokens / max_tokens)): a correct answer scores 1 - weight
    at `max_tokens` tokens and more, rising to 1 as it gets shorter; a wrong one 0. Correct = the
    last number in the completion equals the label. Strict rewards ("#### N", "exactly N")
    leave a small model's GRPO groups without variance; this one ranks what it does write."""
    numbers = _NUMBER.findall(completion)
    correct = float(bool(numbers) and same_number(numbers[-1], str(label)))
    short = 1.0 - weight * min(1.0, len(completion_ids) / max_tokens)
    return {"score": correct * short, "correct": correct, "tokens": float(len(completion_ids))}
