"""Datasets from the user (raytunix.data.datasets): parquet, JSONL and Hugging Face-style
folders written here (GSM8K's layout), read through pyarrow with stable task ids; the
seeded held-out split; reasoning-gym by name; clear errors for bad paths and columns."""

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytunix.data.answers import score_answer
from raytunix.data.datasets import (
    DatasetError,
    DatasetSpec,
    file_splits,
    load_tasks,
    reasoning_gym_splits,
)

# GSM8K's columns: a question, and a worked solution ending in "#### <final answer>".
GSM8K_ROWS = [
    {
        "question": "Tom has 3 boxes of 12 pencils and gives away 5. How many are left?",
        "answer": "He had 3 * 12 = <<3*12=36>>36 pencils.\n36 - 5 = <<36-5=31>>31\n#### 31",
    },
    {
        "question": "A shirt costs $20 and is 25% off. What is the sale price in dollars?",
        "answer": "The discount is 20 * 0.25 = <<20*0.25=5>>5.\n20 - 5 = 15\n#### 15",
    },
    {
        "question": "Ann reads 1,200 pages in 4 weeks. How many pages a week?",
        "answer": "1200 / 4 = <<1200/4=300>>300\n#### 300",
    },
]


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _write_arrow_stream(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _save_to_disk_layout(folder, rows):
    """What datasets' Dataset.save_to_disk writes: Arrow stream shards, state.json,
    dataset_info.json."""
    os.makedirs(folder)
    _write_arrow_stream(os.path.join(folder, "data-00000-of-00001.arrow"), rows)
    with open(os.path.join(folder, "state.json"), "w") as f:
        json.dump({"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": None}, f)
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump(
            {
                "features": {
                    "question": {"dtype": "string", "_type": "Value"},
                    "answer": {"dtype": "string", "_type": "Value"},
                }
            },
            f,
        )


def _check_gsm8k(tasks, split="train"):
    assert [t.answer for t in tasks] == ["31", "15", "300"]
    assert [t.task_id for t in tasks] == [f"{split}-000000", f"{split}-000001", f"{split}-000002"]
    assert tasks[0].question == GSM8K_ROWS[0]["question"]
    assert tasks[0].metadata["solution"].endswith("#### 31")
    assert score_answer(tasks[2], "\\boxed{300}") == 1.0


def test_jsonl_file_in_gsm8k_layout(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    _write_jsonl(path, GSM8K_ROWS)
    tasks = load_tasks(DatasetSpec("jsonl", str(path)))
    _check_gsm8k(tasks)
    assert load_tasks(DatasetSpec("jsonl", str(path))) == tasks  # stable


def test_parquet_file_with_a_column_mapping_and_id_column(tmp_path):
    rows = [
        {"problem": "What is 2 + 2?", "solution": 4, "uid": "p-a", "level": 1},
        {"problem": "What is 10 / 4?", "solution": 2.5, "uid": "p-b", "level": 2},
    ]
    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    tasks = load_tasks(
        DatasetSpec(
            "parquet",
            str(path),
            question_column="problem",
            answer_column="solution",
            id_column="uid",
        )
    )
    assert [(t.task_id, t.answer) for t in tasks] == [("p-a", "4"), ("p-b", "2.5")]
    assert tasks[1].metadata["columns"] == {"level": 2}
    assert score_answer(tasks[1], "5/2") == 1.0


def test_hub_style_folder_of_parquet_shards_per_split(tmp_path):
    # The Hub's GSM8K repository: main/train-00000-of-00001.parquet, main/test-....
    (tmp_path / "gsm8k" / "main").mkdir(parents=True)
    for split in ("train", "test"):
        pq.write_table(
            pa.Table.from_pylist(GSM8K_ROWS),
            tmp_path / "gsm8k" / "main" / f"{split}-00000-of-00001.parquet",
        )
    folder = str(tmp_path / "gsm8k")
    _check_gsm8k(load_tasks(DatasetSpec("parquet", folder, split="test")), "test")
    train, heldout = file_splits(
        DatasetSpec("parquet", folder), DatasetSpec("parquet", folder, split="test"), 10, 10, 0
    )
    assert len(train) == 3
    assert heldout == []  # the same questions: held out only what train has not seen
    with pytest.raises(
        DatasetError, match=r"split 'validation'; splits found: \['main', 'test', 'train'\]"
    ):
        load_tasks(DatasetSpec("parquet", folder, split="validation"))


def test_save_to_disk_dataset_and_dataset_dict(tmp_path):
    _save_to_disk_layout(str(tmp_path / "ds"), GSM8K_ROWS)
    _check_gsm8k(load_tasks(DatasetSpec("hf", str(tmp_path / "ds"))))
    root = tmp_path / "dd"
    root.mkdir()
    (root / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    _save_to_disk_layout(str(root / "train"), GSM8K_ROWS)
    _save_to_disk_layout(str(root / "test"), GSM8K_ROWS[:1])
    _check_gsm8k(load_tasks(DatasetSpec("hf", str(root))))
    assert len(load_tasks(DatasetSpec("hf", str(root), split="test"))) == 1
    with pytest.raises(DatasetError, match=r"no split 'dev'; its splits are \['train', 'test'\]"):
        load_tasks(DatasetSpec("hf", str(root), split="dev"))


def test_seeded_heldout_split_is_disjoint_and_stable(tmp_path):
    rows = [{"question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(50)]
    path = tmp_path / "add.jsonl"
    _write_jsonl(path, rows)
    spec = DatasetSpec("jsonl", str(path))
    train, heldout = file_splits(spec, None, 30, 10, seed=7)
    assert (len(train), len(heldout)) == (30, 10)
    assert not {t.task_id for t in train} & {t.task_id for t in heldout}
    assert file_splits(spec, None, 30, 10, seed=7) == (train, heldout)
    assert file_splits(spec, None, 30, 10, seed=8)[1] != heldout
    # ids are the rows of the file, whatever the split: the same row keeps its id.
    assert all(t.question == rows[int(t.task_id.split("-")[1])]["question"] for t in heldout)
    with pytest.raises(DatasetError, match="data.heldout_size=50 leaves no training rows"):
        file_splits(spec, None, 30, 50, seed=7)


def test_missing_path_and_column_errors_name_what_exists(tmp_path):
    with pytest.raises(DatasetError, match=r"data.path='.*nope.jsonl' does not exist"):
        load_tasks(DatasetSpec("jsonl", str(tmp_path / "nope.jsonl")))
    path = tmp_path / "qa.jsonl"
    _write_jsonl(path, [{"prompt": "Hi?", "target": "1"}])
    with pytest.raises(
        DatasetError,
        match=r"data.question_column='question' is not a column "
        r".* its columns are \['prompt', 'target'\]",
    ):
        load_tasks(DatasetSpec("jsonl", str(path)))
    with pytest.raises(DatasetError, match="data.answer_column='answer'"):
        load_tasks(DatasetSpec("jsonl", str(path), question_column="prompt"))
    with pytest.raises(DatasetError, match="not a .parquet file"):
        load_tasks(DatasetSpec("parquet", str(path)))
    with pytest.raises(DatasetError, match="holds no .arrow files"):
        load_tasks(DatasetSpec("hf", str(tmp_path)))


def test_bad_rows_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_jsonl(
        path,
        [{"question": "ok?", "answer": "1", "id": "a"}, {"question": "", "answer": "2", "id": "b"}],
    )
    with pytest.raises(DatasetError, match="row 1: question column 'question' is ''"):
        load_tasks(DatasetSpec("jsonl", str(path)))
    _write_jsonl(
        path,
        [
            {"question": "a?", "answer": "1", "id": "x"},
            {"question": "b?", "answer": "2", "id": "x"},
        ],
    )
    with pytest.raises(DatasetError, match="id 'x' of data.id_column='id' repeats row 0"):
        load_tasks(DatasetSpec("jsonl", str(path), id_column="id"))
    path.write_text('{"question": "a?", "answer": 1}\n{not json\n')
    with pytest.raises(DatasetError, match="cannot be read as jsonl"):
        load_tasks(DatasetSpec("jsonl", str(path)))


def test_reasoning_gym_by_name():
    train, heldout = reasoning_gym_splits("leg_counting", 20, 5, seed=3)
    assert (len(train), len(heldout)) == (20, 5)
    assert train[0].task_id == "train-000000"
    assert train[0].metadata["entry"]["metadata"]["source_dataset"] == "leg_counting"
    assert not {t.question for t in train} & {t.question for t in heldout}
    assert reasoning_gym_splits("leg_counting", 20, 5, seed=3) == (train, heldout)
    with pytest.raises(
        DatasetError, match="'leg_count' is not a reasoning-gym dataset; did you mean leg_counting"
    ):
        reasoning_gym_splits("leg_count", 2, 1, 0)
    with pytest.raises(DatasetError, match="refuses its settings"):
        reasoning_gym_splits("leg_counting", 2, 1, 0, bogus=1)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.source=jsonl"], "data.source='jsonl' needs data.path"),
        (
            ["data.path=x.jsonl"],
            "data.path='x.jsonl' is read only when data.source is one of parquet, jsonl, hf",
        ),
        (["data.source=csv"], "data.source='csv' is not one of auto, env, reasoning_gym"),
        (
            ["data.dataset=leg_count"],
            "data.dataset='leg_count' is not a reasoning-gym dataset; did you mean leg_counting",
        ),
        (
            ["data.source=parquet", "data.path=a.parquet", "data.dataset_kwargs.min_animals=2"],
            "data.dataset_kwargs=.* configures a reasoning-gym dataset",
        ),
        (
            ["data.source=jsonl", "data.path=a.jsonl", "data.question_column="],
            "data.question_column is empty",
        ),
    ],
)
def test_data_keys_are_validated_by_name(overrides, message):
    from raytunix.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_data_keys_pick_the_source(tmp_path):
    from raytunix.config import load_config
    from raytunix.data.tasks import dataset_splits

    path = tmp_path / "gsm8k.jsonl"
    _write_jsonl(path, GSM8K_ROWS)
    cfg = load_config(
        None,
        ["data.source=jsonl", f"data.path={path}", "data.heldout_size=1", "eval.heldout_size=1"],
    )
    train, heldout = dataset_splits(cfg.data)
    assert (len(train), len(heldout)) == (2, 1)
    assert dataset_splits(load_config(None).data) is None  # auto: the environment first
    # A single file has no "test" split: the error says so, not that every held-out task
    # was dropped as a training question.
    cfg = load_config(
        None,
        [
            "data.source=jsonl",
            f"data.path={path}",
            "data.heldout_split=test",
            "data.heldout_size=1",
            "eval.heldout_size=1",
        ],
    )
    with pytest.raises(
        DatasetError,
        match=r"data.heldout_split='test' names a split, but "
        r"data.path=.* is a single file.*data.heldout_path"
        r".*drop data.heldout_split",
    ):
        dataset_splits(cfg.data)
    cfg = load_config(
        None,
        [
            "data.source=reasoning_gym",
            "data.dataset=leg_counting",
            "data.dataset_kwargs.max_animals=3",
            "data.train_size=4",
            "data.heldout_size=2",
            "eval.heldout_size=2",
        ],
    )
    train, heldout = dataset_splits(cfg.data)
    assert len(train) == 4 and train[0].metadata["entry"]["metadata"]["num_animals"] <= 3
