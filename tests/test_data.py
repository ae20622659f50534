"""Data tasks (tasks/data.py): every file format, both prompt shapes, the chat template, the
seeded cursor across a checkpoint, and a clear error for each kind of bad input."""

from __future__ import annotations

import json

import pytest

from configs.loader import ConfigError, load_config
from configs.schema import TaskConfig
from learner.leases import LeaseTable
from tasks import make_task
from tasks.data import DataError, DataTask

ROWS = [{"prompt": f"What is {i} + 1?", "answer": i + 1, "level": i % 3} for i in range(20)]
REWARD = "tasks.builtin_rewards:exact_match"


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from models.tiny import load_tokenizer

    return load_tokenizer(smollm2_dir)


def _cfg(path, **kw) -> TaskConfig:
    base = dict(name="data", data_path=str(path), label_key="answer", metadata_keys="level",
                reward=REWARD)
    return TaskConfig(**{**base, **kw})


def _write(tmp_path, fmt: str, rows=ROWS):
    import datasets

    tmp_path.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(rows))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    else:
        path = tmp_path / "d_disk"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "disk"])
def test_every_format_gives_the_same_prompts(tmp_path, tok, fmt):
    task = make_task(_cfg(_write(tmp_path, fmt)), tok, seed=1)
    reference = make_task(_cfg(_write(tmp_path, "jsonl")), tok, seed=1)
    assert task.num_train == 18  # eval_fraction 0.1 of 20
    for i in range(25):  # past one epoch
        a, b = task.train_prompt(i), reference.train_prompt(i)
        assert a.meta == b.meta and (a.token_ids == b.token_ids).all()
    assert len(task.eval_prompts(2)) == 2
    p = task.train_prompt(0)
    assert json.loads(p.meta["label"]) in range(1, 21)  # JSON values keep their type
    assert set(json.loads(p.meta["metadata"])) == {"level"}


def test_text_and_chat_prompts_render_with_the_template(tmp_path, tok):
    text = [{"prompt": "Hi there", "answer": 1}] * 4
    chat = [{"prompt": [{"role": "user", "content": "Hi there"}], "answer": 1}] * 4
    t1 = make_task(_cfg(_write(tmp_path / "a", "jsonl", text), metadata_keys="",
                        eval_fraction=0.25), tok)
    t2 = make_task(_cfg(_write(tmp_path / "b", "jsonl", chat), metadata_keys="",
                        eval_fraction=0.25), tok)
    a, b = t1.train_prompt(0).token_ids, t2.train_prompt(0).token_ids
    assert (a == b).all()
    rendered = tok.decode(a.tolist())
    assert rendered.startswith("<|im_start|>system\n")  # the template's default system prompt
    assert rendered.endswith("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    t3 = make_task(_cfg(t1.cfg.data_path, metadata_keys="", eval_fraction=0.25,
                        system_prompt="Be brief."), tok)
    assert tok.decode(t3.train_prompt(0).token_ids.tolist()).startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there")


def test_plain_text_prompt_without_a_template_is_tokenized_as_is(tmp_path, tiny_model_dir):
    from models.tiny import load_tokenizer

    tiny = load_tokenizer(tiny_model_dir)
    path = _write(tmp_path, "jsonl", [{"prompt": "rev 1 2 3 4 =", "answer": "4321"}] * 3)
    task = make_task(_cfg(path, metadata_keys="", eval_fraction=0.34), tiny)
    assert tiny.convert_ids_to_tokens(task.train_prompt(0).token_ids.tolist()) == \
        ["rev", "1", "2", "3", "4", "="]


def test_seeded_epochs_and_held_out_split(tmp_path, tok):
    path = _write(tmp_path, "jsonl")
    a, b = make_task(_cfg(path), tok, seed=0), make_task(_cfg(path), tok, seed=1)
    rows = lambda t, lo, hi: [t.position(i)[1] for i in range(lo, hi)]  # noqa: E731
    assert sorted(rows(a, 0, 18)) == list(range(18))  # one epoch visits every row once
    assert sorted(rows(a, 18, 36)) == list(range(18))
    assert rows(a, 0, 18) != rows(a, 18, 36)  # each epoch in its own order
    assert rows(a, 0, 18) != rows(b, 0, 18)  # the seed changes the order ...
    held = lambda t: [p.meta["label"] for p in t.eval_prompts(2)]  # noqa: E731
    assert held(a) == held(b)  # ... not the held-out rows
    train_labels = {a.train_prompt(i).meta["label"] for i in range(18)}
    assert not train_labels & set(held(a))
    unshuffled = make_task(_cfg(path, shuffle=False), tok)
    assert rows(unshuffled, 0, 18) == list(range(18))
    sep = make_task(_cfg(path, eval_path=str(_write(tmp_path / "e", "jsonl", ROWS[:3]))), tok)
    assert sep.num_train == 20 and [p.meta["label"] for p in sep.eval_prompts(3)] == ["1", "2", "3"]


def test_cursor_resumes_exactly_from_lease_state(tmp_path, tok):
    """The learner checkpoints LeaseTable.state() (cursor, retries) in state.json; a new task
    and table loaded from it grant exactly the prompts the old one would have."""
    path = _write(tmp_path, "parquet")
    old = LeaseTable(make_task(_cfg(path), tok, seed=7), 4, 2, 1)
    for _ in range(11):
        old.grant("a", "inc", 3, version=10)
    state = json.loads(json.dumps(old.state()))
    new = LeaseTable(make_task(_cfg(path), tok, seed=7), 4, 2, 1)
    new.load_state(state)
    after_old = [r.prompt.meta for r in old.grant("a", "inc", 8, 10)]
    after_new = [r.prompt.meta for r in new.grant("a", "inc", 8, 10)]
    assert after_old == after_new and len(after_new) == 8
    assert old.cursor == new.cursor == 41  # past two epochs of 18 rows


@pytest.mark.parametrize("content, fmt, message", [
    ('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2\n', "jsonl", r"d\.jsonl:2: not valid JSON"),
    ('{"prompt": "a", "answer": 1}\n[1, 2]\n', "jsonl", r"d\.jsonl:2: a line must hold a JSON object"),
    ('{"prompt": "a", "answer": 1}\n{"question": "b", "answer": 2}\n', "jsonl",
     r"d\.jsonl: row 1: column 'prompt' \(task.prompt_key\) is missing or null"),
    ('{"prompt": "a", "answer": 1}\n{"prompt": "b"}\n', "jsonl",
     r"row 1: column 'answer' \(task.label_key\) is missing or null"),
    ('{"prompt": "a"}\n', "jsonl", r"row 0: no column 'answer' \(task.label_key\); columns: \['prompt'\]"),
    ('{"prompt": "a", "answer": 1}\n{"prompt": 5, "answer": 2}\n', "jsonl",
     r"row 1: column 'prompt' \(task.prompt_key\) must be a string or a non-empty list"),
    ('{"prompt": [{"role": "user"}], "answer": 1}\n', "jsonl", r"row 0: column 'prompt' .* message 0 must be"),
    ("not parquet at all", "parquet", r"d\.parquet: cannot read it as \.parquet"),
    ("a,b\n1,2\n", "csv", r"unknown format '\.csv'"),
])
def test_bad_input_errors_name_file_row_and_column(tmp_path, tok, content, fmt, message):
    path = tmp_path / f"d.{fmt}"
    path.write_text(content)
    task = make_task(_cfg(path, metadata_keys="", eval_fraction=0.0), tok)
    with pytest.raises(DataError, match=message):
        task.train_prompt(0)


def test_missing_metadata_column_and_paths(tmp_path, tok):
    path = _write(tmp_path, "jsonl")
    with pytest.raises(DataError, match=r"row 0: no column 'source' \(task.metadata_keys\)"):
        make_task(_cfg(path, metadata_keys="level,source"), tok).train_prompt(0)
    with pytest.raises(DataError, match=r"nope.jsonl does not exist"):
        make_task(_cfg(tmp_path / "nope.jsonl"), tok).train_prompt(0)
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match=r"DatasetDict with splits \['train'\]"):
        make_task(_cfg(tmp_path / "dd"), tok).train_prompt(0)


def test_config_names_the_field():
    with pytest.raises(ConfigError, match="task.data_path must be set"):
        load_config(None, ["task.name=data"])
    with pytest.raises(ConfigError, match="task.name must be one of reverse, calculator"):
        load_config(None, ["task.name=nonsense"])
    with pytest.raises(ConfigError, match="task.reward must be an import path"):
        load_config(None, ["task.reward=foo"])
    cfg = load_config(None, ["task.name=data", "task.data_path=x.jsonl", "task.reward=a.b:c",
                             "task.template_kwargs={enable_thinking: false}"])
    assert cfg.task.template_kwargs == {"enable_thinking": False}


def test_task_by_import_path(tmp_path, tok):
    mod = tmp_path / "my_task.py"
    mod.write_text("from tasks.data import DataTask\n"
                   "def make_task(cfg, tokenizer, seed):\n"
                   "    t = DataTask(cfg, tokenizer, seed, rows=([{'prompt': 'x', 'label': 1}],"
                   " [{'prompt': 'y', 'label': 2}]))\n"
                   "    t.name = 'mine'\n    return t\n")
    task = make_task(TaskConfig(name=f"{mod}:make_task", reward=REWARD), tok)
    assert task.name == "mine" and task.eval_prompts(1)[0].meta["label"] == "2"
    with pytest.raises(ValueError, match=r"task.name .*no module named 'no_such_pkg'"):
        make_task(TaskConfig(name="no_such_pkg.tasks:make_task"), tok)
    assert isinstance(make_task(TaskConfig(name="additions", num_digits=1), tok), DataTask)
    with pytest.raises(ValueError, match="task.num_digits must be 1 or 2 for the additions"):
        make_task(TaskConfig(name="additions", num_digits=4), tok)
