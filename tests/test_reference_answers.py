"""A row without a usable reference answer is never free reward: every dataset loader
refuses it naming the row and the column, an empty reference never matches any answer,
and the environments that score answers give it 0. Answers and the held-out leak check
normalise Unicode the same way (NFKC, invisible characters removed)."""

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytunix.agents.parsers import parse_answer_action
from raytunix.data.answers import answers_match, blank_answer, normalize_text, text_key
from raytunix.data.datasets import (
    DatasetError,
    DatasetSpec,
    drop_leaked,
    entry_task,
    file_splits,
    load_tasks,
)
from raytunix.envs import CalculatorMathEnv, MathVerifierEnv
from raytunix.envs.reasoning_gym_env import ReasoningGymEnv
from raytunix.types import Action, Task

BLANK_ANSWERS = [
    "",
    "   ",
    "\t\n",
    "\u3000",
    "\u00a0",
    "\u200b",
    "\u200b\u200c\u200d",
    "\ufeff",
    "\u2060",
    ".",
    "$$",
    "\\boxed{}",
    "\\( \\)",
    "work: 3 + 4 = 7 #### ",
    "####",
    "#### \u200b",
    "steps #### $$",
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _save_to_disk(folder, table):
    os.makedirs(folder)
    with (
        pa.OSFile(os.path.join(folder, "data-00000-of-00001.arrow"), "wb") as sink,
        pa.ipc.new_stream(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}, f)
    return folder


@pytest.mark.parametrize("bad", BLANK_ANSWERS)
def test_a_jsonl_row_with_a_blank_answer_is_refused_by_row_and_column(tmp_path, bad):
    path = _jsonl(
        tmp_path / "rows.jsonl",
        [
            {"question": "1+1?", "answer": "2"},
            {"question": "no answer here", "answer": bad},
            {"question": "2+2?", "answer": "4"},
        ],
    )
    with pytest.raises(DatasetError) as e:
        load_tasks(DatasetSpec("jsonl", path))
    message = str(e.value)
    assert "row 1: answer column 'answer'" in message
    assert "1 of the 3 rows have none (rows 1)" in message
    assert "fill in their 'answer' or remove them" in message


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_parquet_float_nan_or_infinite_answer_is_refused(tmp_path, value):
    path = str(tmp_path / "rows.parquet")
    pq.write_table(
        pa.table({"question": ["3+4?", "missing one"], "answer": np.array([7.0, value])}), path
    )
    with pytest.raises(
        DatasetError,
        match=r"row 1: answer column 'answer' is (nan|inf|-inf) "
        r"\(a float (nan|inf|-inf), not an answer",
    ):
        load_tasks(DatasetSpec("parquet", path))


def test_null_answers_in_every_file_source_are_refused_listing_the_rows(tmp_path):
    table = pa.table(
        {
            "q": [f"question {i}" for i in range(14)],
            "a": [None if i % 4 == 1 else str(i) for i in range(13)] + [None],
        }
    )
    pq.write_table(table, str(tmp_path / "rows.parquet"))
    _save_to_disk(str(tmp_path / "saved"), table)
    for spec in (
        DatasetSpec(
            "parquet", str(tmp_path / "rows.parquet"), question_column="q", answer_column="a"
        ),
        DatasetSpec("hf", str(tmp_path / "saved"), question_column="q", answer_column="a"),
    ):
        with pytest.raises(DatasetError) as e:
            load_tasks(spec)
        assert "row 1: answer column 'a' is None (missing)" in str(e.value)
        assert "4 of the 14 rows have none (rows 1, 5, 9, 13)" in str(e.value)


def test_a_nan_marker_is_refused_in_a_numeric_column_and_kept_in_a_text_one(tmp_path):
    # pandas' astype(str) writes a missing number as "nan".
    numeric = _jsonl(
        tmp_path / "numeric.jsonl",
        [
            {"question": "6*7?", "answer": "42"},
            {"question": "lost", "answer": "nan"},
            {"question": "half of 3?", "answer": "1.5"},
        ],
    )
    with pytest.raises(
        DatasetError,
        match=r"row 1: answer column 'answer' is 'nan', a "
        "missing-value marker",
    ):
        load_tasks(DatasetSpec("jsonl", numeric))
    words = _jsonl(
        tmp_path / "words.jsonl",
        [
            {"question": "Which of 2, 4, 6 is odd?", "answer": "None"},
            {"question": "What did Tom call his grandmother?", "answer": "Nan"},
            {"question": "Capital of France?", "answer": "Paris"},
        ],
    )
    assert [t.answer for t in load_tasks(DatasetSpec("jsonl", words))] == ["None", "Nan", "Paris"]


def test_a_question_of_invisible_characters_only_is_refused(tmp_path):
    path = _jsonl(tmp_path / "rows.jsonl", [{"question": "\u200b\ufeff ", "answer": "3"}])
    with pytest.raises(DatasetError, match="row 0: question column 'question'"):
        load_tasks(DatasetSpec("jsonl", path))


def test_usable_references_still_load(tmp_path):
    path = _jsonl(
        tmp_path / "rows.jsonl",
        [
            {"question": "a", "answer": "0"},
            {"question": "b", "answer": "work #### 0"},
            {"question": "c", "answer": "\u2205"},
            {"question": "d", "answer": "x"},
        ],
    )
    assert [t.answer for t in load_tasks(DatasetSpec("jsonl", path))] == ["0", "0", "\u2205", "x"]


@pytest.mark.parametrize("reference", BLANK_ANSWERS[:12])
@pytest.mark.parametrize("given", ["", ".", "  ", "$$", "\u200b", "\\boxed{}", "0", "None"])
def test_a_blank_reference_never_matches(given, reference):
    assert blank_answer(reference)
    assert answers_match(given, reference) is False


def test_blank_answer_answers_nothing_on_non_blank_text():
    for text in ("0", "x", "+", "\u2205", "\\infty", "$5", "\uff10"):
        assert not blank_answer(text), text


@pytest.mark.parametrize("env", [MathVerifierEnv, CalculatorMathEnv])
@pytest.mark.parametrize(
    "reply",
    ["<answer></answer>", "<answer> </answer>", "<answer>\u200b</answer>", "<answer>$$</answer>"],
)
def test_answering_nothing_on_an_empty_reference_earns_no_reward(env, reply):
    env = env()
    env.reset(Task("t", "What is 6*7?", ""))
    action = parse_answer_action(reply)
    assert action.answer is not None
    assert env.step(action).reward == 0.0


def test_a_reasoning_gym_entry_with_a_blank_answer_scores_nothing():
    entry = {
        "question": "Spell 'a' backward.",
        "answer": " ",
        "metadata": {"source_dataset": "spell_backward"},
    }
    env = ReasoningGymEnv()
    env.reset(Task("t", entry["question"], " ", {"entry": entry}))
    step = env.step(Action(text="<answer> </answer>", answer=" "))
    assert step.reward == 0.0 and step.info["empty_reference"] is True
    # The control: the same scorer pays a right answer on a real reference.
    entry = {**entry, "answer": "a"}
    env.reset(Task("t", entry["question"], "a", {"entry": entry}))
    assert env.step(Action(text="<answer>a</answer>", answer="a")).reward == 1.0


def test_a_reasoning_gym_entry_is_refused_for_a_blank_answer_and_kept_for_none():
    with pytest.raises(
        DatasetError,
        match=r"reasoning-gym 'spell_backward' entry train-000003 "
        r"\(generator seed 3\) has answer ''",
    ):
        entry_task(
            "train-000003", {"question": "q", "answer": "", "metadata": {}}, "spell_backward", 3
        )
    # None: the dataset's scorer verifies a solution (rubiks_cube); "" never matches text.
    task = entry_task("train-0", {"question": "q", "answer": None, "metadata": {}})
    assert task.answer == "" and task.metadata["entry"]["answer"] is None


@pytest.mark.parametrize(
    "given,reference",
    [
        ("\uff14\uff12", "42"),  # fullwidth digits
        ("4\u200b2", "42"),  # zero-width space
        ("4\u200d2", "42"),  # zero-width joiner
        ("\ufeff42", "42"),  # BOM
        ("1\u00a0000", "1 000"),  # no-break space
        ("\uff30\uff41\uff52\uff49\uff53", "paris"),  # fullwidth letters
        ("Pa\u00adris", "Paris"),  # soft hyphen
        ("\u00bd", "1/2"),  # NFKC's 1⁄2, fraction slash read as /
        ("x\u00b2", "x^{2}"),  # a superscript is a power, not a digit (NFKC would say x2)
    ],
)
def test_unicode_forms_of_an_answer_match_its_plain_form(given, reference):
    assert answers_match(given, reference) is True
    assert answers_match(reference, given) is True


def test_a_superscript_is_not_read_as_a_digit():
    assert normalize_text("2\u00b3") == "2^{3}"
    assert answers_match("2\u00b3", "23") is False


@pytest.mark.parametrize(
    "copy",
    [
        "What is 12 + 30?\u200b",
        "What is \u200d12 + 30?",
        "\ufeffWhat is 12 + 30?",
        "What is \uff11\uff12 + 30?",
        "What\u00a0is 12 + 30?",
        "WHAT IS 12 + 30?",
    ],
)
def test_a_heldout_question_that_is_a_training_one_in_another_unicode_form_is_a_leak(copy):
    train = [Task("train-0", "What is 12 + 30?", "42")]
    heldout = [Task("heldout-0", copy, "42"), Task("heldout-1", "What is 12 + 31?", "43")]
    assert [t.task_id for t in drop_leaked(train, heldout)] == ["heldout-1"]
    assert text_key(copy) == text_key(train[0].question)


def test_file_splits_drop_a_zero_width_copy_of_a_training_question(tmp_path):
    train = _jsonl(
        tmp_path / "train.jsonl",
        [{"question": "Add 2 and 3.", "answer": "5"}, {"question": "Add 4 and 3.", "answer": "7"}],
    )
    test = _jsonl(
        tmp_path / "test.jsonl",
        [
            {"question": "Add\u200b 2 and 3.", "answer": "5"},
            {"question": "Add 9 and 3.", "answer": "12"},
        ],
    )
    _, held = file_splits(
        DatasetSpec("jsonl", train), DatasetSpec("jsonl", test, split="test"), 10, 10, 0
    )
    assert [t.question for t in held] == ["Add 9 and 3."]
