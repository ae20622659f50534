"""The GSM8K-style JSONL task: answer extraction, data validation, prompts and rewards."""

import json

import numpy as np
import pytest

from tasks.gsm8k import GSM8KTask, final_number


@pytest.mark.parametrize("text, want", [
    ("3 + 4 = 7 so #### 7", "7"),
    ("#### 1,234.", "1234"),
    ("first 12 then 15", "15"),
    ("#### -3 and later 9", "-3"),
    ("no digits here", None),
    ("the answer is 2.50", "2.50"),
])
def test_final_number(text, want):
    assert final_number(text) == want


class _CharTokenizer:
    """A named fake: one id per character, a trivial chat template."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, return_dict):
        return [ord(c) for c in "U:" + messages[0]["content"] + "\nA:"]

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(i) for i in ids)


def _write(path, n, bad_line=None):
    lines = [json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i}+{i}=#### {2 * i}"})
             for i in range(n)]
    if bad_line is not None:
        lines[3] = bad_line
    path.write_text("\n".join(lines) + "\n")


def test_prompts_rewards_and_held_out_split(tmp_path):
    _write(tmp_path / "d.jsonl", 30)
    task = GSM8KTask(_CharTokenizer(), data_path=str(tmp_path / "d.jsonl"), seed=1)
    p = task.train_prompt(5)
    text = "".join(chr(i) for i in p.token_ids)
    assert text.startswith("U:What is") and text.endswith("\nA:")
    n = int(text.split("What is ")[1].split(" ")[0])
    assert n % 10 != 0  # every 10th problem is held out
    answer = np.array([ord(c) for c in f"so #### {2 * n}"])
    assert task.reward(p.meta, answer) == 1.0
    assert task.reward(p.meta, np.array([ord(c) for c in "#### 99999"])) == 0.0
    assert [q.meta["target"] for q in task.eval_prompts(3)] == ["0", "20", "40"]


def test_bad_data_names_file_and_line(tmp_path):
    _write(tmp_path / "d.jsonl", 30, bad_line=json.dumps({"question": "x", "answer": "no marker"}))
    task = GSM8KTask(_CharTokenizer(), data_path=str(tmp_path / "d.jsonl"))
    with pytest.raises(ValueError, match=r"d.jsonl:4: need"):
        task.train_prompt(0)
    with pytest.raises(FileNotFoundError, match="task.data_path"):
        GSM8KTask(_CharTokenizer(), data_path=str(tmp_path / "missing.jsonl")).train_prompt(0)
