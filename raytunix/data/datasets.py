"""A run's tasks from a dataset on disk (parquet, JSONL, Hugging Face-style folders) or
from any reasoning-gym generator by name. Nothing is downloaded.

Sources (``data.source``):

* ``parquet``: a ``.parquet`` file, or a folder of parquet shards per split;
* ``jsonl``: a ``.jsonl`` file (one JSON object a line), or a folder of JSONL shards per
  split;
* ``hf``: a folder written by Hugging Face ``datasets``' ``save_to_disk``: a ``Dataset``
  (``*.arrow`` files beside ``dataset_info.json`` / ``state.json``) or a ``DatasetDict``
  (``dataset_dict.json`` and one such folder per split);
* ``reasoning_gym``: ``reasoning_gym.create_dataset(data.dataset, ...)``.

In a folder of shards, a split's files are those named ``<split>.<ext>`` or
``<split>-*.<ext>`` (the Hub's ``train-00000-of-00001.parquet``) anywhere below the
folder, or every file in a sub-folder named ``<split>``; shards are read in name order.

Rows become ``Task``\\ s through a column mapping (``data.question_column``,
``data.answer_column``, ``data.id_column``). An answer holding ``####`` keeps the text
after the last ``####`` as the answer (GSM8K's layout: worked solution, then
``#### 72``); the whole text stays in ``metadata["solution"]``. Task ids are stable: the id
column's value, else ``<split>-<row index in the source>``, so the same file gives the
same ids whatever the sizes or the seed.

Every row needs a usable reference answer, or the policy could earn reward by answering
nothing: a row whose answer is missing (null / None), a float NaN or infinity, or blank
(``raytunix.data.answers.blank_answer``: empty, whitespace or invisible characters only,
``$$``, LaTeX that typesets as space such as ``\\quad`` or ``\\text{}``, nothing after the
GSM8K mark), a reference longer than ``MAX_ANSWER_CHARS`` (256: answers that long are never
compared, so the row could never be rewarded), or a float64 integer past 2^53 (where a
float64 no longer holds every integer, so the stored value may not be the answer written),
is refused, naming the row and the column. JSON ``true``/``false`` answers read as written;
a UTF-8 byte-order mark before a JSONL file's first line is not part of it. JSONL answers that are JSON numbers are kept as their text, digit for digit. A text
answer that reads as a missing-value marker (``nan``, ``None``, ``null``, ``N/A``,
``<NA>``, ``NaT``, any case) is refused only when every other answer of the split is a
number: that is what a numeric column turned into text (pandas' ``astype(str)``) looks
like, while in a text dataset ``"None"`` or ``"Nan"`` can be a true answer.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import random
from typing import Any, Sequence, get_args

import numpy as np
import pyarrow as pa

from raytunix.config import FileSource
from raytunix.data.answers import MAX_ANSWER_CHARS, blank_answer, parse_number, text_key, unwrap
from raytunix.types import Task

FILE_SOURCES: tuple[str, ...] = get_args(FileSource)  # declared with data.source
GSM8K_ANSWER_MARK = "####"
_FLOAT64_EXACT = 2**53  # every integer below this is a float64 of its own
_EXTENSIONS = {"parquet": (".parquet",), "jsonl": (".jsonl", ".json")}
# Text a numeric column turned into strings holds where a value was missing.
MISSING_MARKERS = frozenset({"nan", "-nan", "none", "null", "na", "n/a", "<na>", "nat"})
_SHOWN_ROWS = 10  # bad rows listed by number in one error


class DatasetError(ValueError):
    """A dataset cannot be read as configured; the message names the key, the value and
    what exists instead."""


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """Where a split's rows are and how they map to tasks (the ``data.*`` keys)."""

    source: str  # parquet | jsonl | hf
    path: str  # file or folder
    split: str = "train"  # split inside a folder
    question_column: str = "question"
    answer_column: str = "answer"
    id_column: str = ""  # "" = "<split>-<row>"
    key: str = "data.path"  # config key named in errors


def read_records(spec: DatasetSpec) -> tuple[list[str], list[dict[str, Any]]]:
    """The rows of ``spec``'s split: its column names and one dict per row.

    JSONL is read with Python's ``json``, so numbers keep their exact value and a column
    may mix types (Arrow's JSON reader turned an integer past int64, and every number of a
    column mixing 4 and 2.5, into a float64 whose digits past 2^53 are not the file's, and
    refused a column mixing numbers and text). The answer column's numbers come as their
    text (``12345678901234567890``, ``2.50``), the other columns' as ``int`` or ``float``.

    Raises:
      DatasetError: the path does not exist, is the wrong kind for ``spec.source``, the
        split is not in the folder (the splits found are listed), or a file cannot be
        parsed (a JSONL line that is not a JSON object is named by its line number).
    """
    if spec.source not in FILE_SOURCES:
        raise DatasetError(
            f"data.source={spec.source!r} is not a file source; use one of "
            f"{', '.join(FILE_SOURCES)}."
        )
    path = spec.path
    if not path or not os.path.exists(path):
        raise DatasetError(
            f"{spec.key}={path!r} does not exist (working directory "
            f"{os.getcwd()}); give the dataset's file or folder."
        )
    if spec.source == "hf":
        return _arrow_records(_read_saved_dataset(spec), spec.answer_column)
    files = [path] if os.path.isfile(path) else _shards(spec)
    if spec.source == "jsonl":
        columns: dict[str, None] = {}
        records: list[dict[str, Any]] = []
        for file in files:
            records += _read_jsonl(file, spec.key, spec.answer_column)
        for record in records:
            columns.update(dict.fromkeys(record))
        return list(columns), records
    table = pa.concat_tables([_read_parquet(f, spec.key) for f in files], promote_options="default")
    return _arrow_records(table, spec.answer_column)


class _InexactNumber(str):
    """An answer cell of a float16/float32 column whose integer value that type cannot
    hold apart from its neighbours (past 2^11 / 2^24): what was written is unknown."""


def _arrow_records(table: pa.Table, answer_column: str) -> tuple[list[str], list[dict[str, Any]]]:
    """``table``'s column names and rows; a float16/float32 answer column as the shortest
    text that reads back as the stored value (``0.1``, not the float64 widening
    ``0.10000000149011612``)."""
    records = table.to_pylist()
    if answer_column in table.column_names:
        kind = table.schema.field(answer_column).type
        if pa.types.is_float16(kind) or pa.types.is_float32(kind):
            narrow, exact = (
                (np.float16, 2**11) if pa.types.is_float16(kind) else (np.float32, 2**24)
            )
            for record in records:
                value = record.get(answer_column)
                if isinstance(value, float) and math.isfinite(value):
                    text = np.format_float_positional(narrow(value), unique=True, trim="-")
                    inexact = value.is_integer() and abs(value) >= exact
                    record[answer_column] = _InexactNumber(text) if inexact else text
    return table.column_names, records


def load_tasks(spec: DatasetSpec) -> list[Task]:
    """Every row of ``spec``'s split as a ``Task`` in source order (see the module doc for
    ids, the GSM8K answer layout and metadata).

    Returns:
      tasks with ``metadata`` holding ``row`` (index in the source), ``split``,
      ``solution`` (GSM8K layout only) and ``columns`` (the row's other scalar columns).

    Raises:
      DatasetError: see ``read_records``; a mapped column is missing (the columns that exist
        are listed); a question is empty; a row has no usable reference answer (see the
        module doc; the first such row is named, with the count and the numbers of the
        others); ids of the id column repeat.
    """
    names, records = read_records(spec)
    _check_columns(spec, names)
    used = {spec.question_column, spec.answer_column, spec.id_column}
    tasks, seen, bad, markers = [], {}, [], []
    for row, record in enumerate(records):
        question, raw = record.get(spec.question_column), record.get(spec.answer_column)
        where = f"{spec.path!r} (split {spec.split!r}) row {row}"
        if not isinstance(question, str) or not text_key(question):
            raise DatasetError(
                f"{where}: question column {spec.question_column!r} is "
                f"{question!r}; every row needs a question text."
            )
        answer, solution, problem = _row_answer(spec, raw, where)
        if problem:
            bad.append((row, problem))
            continue
        metadata: dict[str, Any] = {"row": row, "split": spec.split}
        if solution is not None:
            metadata["solution"] = solution
        if answer.strip().casefold() in MISSING_MARKERS:
            markers.append(
                (
                    row,
                    f"{where}: answer column {spec.answer_column!r} is "
                    f"{raw!r:.80}, a missing-value marker, in a column whose "
                    "other answers are all numbers",
                )
            )
        metadata["columns"] = {
            k: v
            for k, v in record.items()
            if k not in used and isinstance(v, (str, int, float, bool))
        }
        task_id = _task_id(spec, row, record, where, seen)
        seen[task_id] = row
        tasks.append(Task(task_id=task_id, question=question, answer=answer, metadata=metadata))
    _check_answers(spec, tasks, bad, markers, len(records))
    return tasks


def _check_columns(spec: DatasetSpec, names: list[str]) -> None:
    """Each column ``spec`` maps (question, answer, id if set) is one of ``names``; raises
    DatasetError naming the key and listing the columns there are."""
    for key, column in (
        ("data.question_column", spec.question_column),
        ("data.answer_column", spec.answer_column),
        ("data.id_column", spec.id_column),
    ):
        if column and column not in names:
            raise DatasetError(
                f"{key}={column!r} is not a column of {spec.path!r} (split {spec.split!r}); its "
                f"columns are {names}. Set {key} to the column that holds it."
            )


def _row_answer(spec: DatasetSpec, raw: Any, where: str) -> tuple[str, str | None, str]:
    """One row's reference answer from its answer cell ``raw``: ``(answer, solution,
    "")``, where ``solution`` is the whole cell in the GSM8K layout (worked solution, then
    ``#### answer``) and None otherwise, or ``("", None, problem)`` naming the row
    (``where``) and why the cell cannot be an answer."""
    answer, why = _reference(raw)
    if why:
        return "", None, f"{where}: answer column {spec.answer_column!r} is {raw!r:.80} ({why})"
    if GSM8K_ANSWER_MARK not in answer:
        return answer, None, ""
    solution = answer
    answer = answer.rsplit(GSM8K_ANSWER_MARK, 1)[1].strip()
    if blank_answer(answer):
        return (
            "",
            None,
            f"{where}: answer column {spec.answer_column!r} is "
            f"{raw!r:.80}, with nothing after its last "
            f"{GSM8K_ANSWER_MARK!r} mark (the GSM8K layout's answer)",
        )
    return answer, solution, ""


def _task_id(
    spec: DatasetSpec, row: int, record: dict[str, Any], where: str, seen: dict[str, int]
) -> str:
    """Row ``row``'s task id: its ``data.id_column`` cell, or ``<split>-<row>`` when that
    key is empty; raises DatasetError when the id is already in ``seen`` (id -> row)."""
    task_id = str(record[spec.id_column]) if spec.id_column else f"{spec.split}-{row:06d}"
    if task_id in seen:
        raise DatasetError(
            f"{where}: id {task_id!r} of data.id_column={spec.id_column!r} "
            f"repeats row {seen[task_id]}; ids must be unique (the rollout "
            "ledger counts each task once). Use another column or leave "
            "data.id_column empty for row-number ids."
        )
    return task_id


def _check_answers(
    spec: DatasetSpec,
    tasks: list[Task],
    bad: list[tuple[int, str]],
    markers: list[tuple[int, str]],
    n_records: int,
) -> None:
    """Raises DatasetError when rows lack a reference answer: the ``bad`` ones (row, why),
    and the ``markers`` ones (text such as ``nan``) when every other answer is a number,
    so the marker stood for a missing number. The first row is named, with the count."""
    marked = {r for r, _ in markers}
    if markers and all(
        parse_number(unwrap(t.answer)) is not None for t in tasks if t.metadata["row"] not in marked
    ):
        bad = sorted(bad + markers)
    if bad:
        rows = [r for r, _ in bad]
        shown = ", ".join(map(str, rows[:_SHOWN_ROWS]))
        shown += ", ..." if len(rows) > _SHOWN_ROWS else ""
        raise DatasetError(
            f"{bad[0][1]}: every row needs a reference answer the reward can be checked "
            f"against, or the policy earns reward by answering nothing. {len(rows)} of the "
            f"{n_records} rows have none (rows {shown}); fill in their "
            f"{spec.answer_column!r} or remove them from the dataset."
        )


def _reference(value: Any) -> tuple[str, str]:
    """``(answer text, "")`` for a usable answer cell, else ``("", why not)``."""
    if value is None:
        return "", "missing"
    if isinstance(value, _InexactNumber):
        return "", (
            "an integer past what its float16/float32 column holds exactly (2^11 / "
            "2^24): the stored value may not be the answer written; store answers as "
            "text"
        )
    if isinstance(value, (dict, list)):
        return "", "not a text or number"
    if isinstance(value, bool):  # JSON true/false as written, not Python's True/False
        value = "true" if value else "false"
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError:
            return "", "bytes that are not UTF-8 text"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "", f"a float {value}, not an answer; write a true infinite answer as text"
        if value.is_integer() and abs(value) >= _FLOAT64_EXACT:  # 2^53 + 1 reads as 2^53
            return "", (
                "a float64 at or past 2^53, where it no longer holds every integer: the "
                "stored value may not be the answer written; store answers as text"
            )
        # A numeric column mixing 4 and 2.5 is read as doubles; 4.0 was written 4.
        value = str(int(value)) if value.is_integer() else str(value)
    answer = str(value)
    if GSM8K_ANSWER_MARK not in answer and blank_answer(answer):
        return "", "blank: nothing to compare an answer with"
    compared = answer.rsplit(GSM8K_ANSWER_MARK, 1)[-1].strip()
    if len(compared) > MAX_ANSWER_CHARS:
        return "", (
            f"{len(compared)} characters, over the {MAX_ANSWER_CHARS} an answer is "
            "compared up to (longer ones never match, so the row could never be "
            "rewarded); shorten the reference or drop the row"
        )
    return answer, ""


def file_splits(
    train: DatasetSpec, heldout: DatasetSpec | None, train_size: int, heldout_size: int, seed: int
) -> tuple[list[Task], list[Task]]:
    """Train and held-out tasks of a dataset on disk.

    Args:
      train: the training split.
      heldout: the held-out split, or None to hold out ``heldout_size`` rows of the
        training split drawn with ``seed`` (they are then not trained on).
      train_size: most training tasks kept (the first ones, in source order).
      heldout_size: most held-out tasks kept.
      seed: seed of the held-out draw.

    Returns:
      ``(train, heldout)``; held-out tasks whose question is also a training question are
      dropped (see ``drop_leaked``).

    Raises:
      DatasetError: see ``load_tasks``; the training split has no rows left to train on;
        ``heldout`` is the training file itself (a single file has no splits).
    """
    if (
        heldout is not None
        and os.path.isfile(heldout.path)
        and os.path.abspath(heldout.path) == os.path.abspath(train.path)
    ):
        # A single file has no splits: its rows would be both trained on and held out,
        # and every held-out task would then be dropped as a training question.
        raise DatasetError(
            f"data.heldout_split={heldout.split!r} names a split, but {train.key}="
            f"{train.path!r} is a single file, which has no splits. Give the held-out "
            "file as data.heldout_path, or drop data.heldout_split to hold out "
            "data.heldout_size rows of the file (drawn with data.seed)."
        )
    tasks = load_tasks(train)
    if heldout is not None:
        held = load_tasks(heldout)[:heldout_size]
    else:
        if heldout_size >= len(tasks):
            raise DatasetError(
                f"data.heldout_size={heldout_size} leaves no training rows of the "
                f"{len(tasks)} in {train.path!r}; lower it or give data.heldout_path / "
                "data.heldout_split."
            )
        chosen = set(random.Random(seed).sample(range(len(tasks)), heldout_size))
        held = [t for i, t in enumerate(tasks) if i in chosen]
        tasks = [t for i, t in enumerate(tasks) if i not in chosen]
    tasks = tasks[:train_size]
    if not tasks:
        raise DatasetError(f"{train.key}={train.path!r} (split {train.split!r}) has no rows.")
    return tasks, drop_leaked(tasks, held)


def drop_leaked(train: Sequence[Task], heldout: Sequence[Task]) -> list[Task]:
    """``heldout`` without the tasks whose question is a training question, so held-out
    success measures generalisation. Questions compare by ``raytunix.data.answers.text_key``
    (Unicode NFKC, invisible characters removed, whitespace collapsed, case folded, as
    answers compare), so a copy that differs by a zero-width space or a fullwidth digit
    counts as the same question."""
    seen = {text_key(t.question) for t in train}
    return [t for t in heldout if text_key(t.question) not in seen]


def reasoning_gym_splits(
    name: str, train_size: int, heldout_size: int, seed: int, **dataset_kwargs: Any
) -> tuple[list[Task], list[Task]]:
    """Train and held-out tasks from reasoning-gym's generator ``name``.

    reasoning-gym draws entry ``i`` from ``Random(seed + i)``: held-out entries come from
    seeds after the training range, and questions already seen (compared by
    ``raytunix.data.answers.text_key``, as ``drop_leaked`` does) are skipped and replaced
    (up to ``10 * heldout_size + 1000`` draws).

    Returns:
      ``(train, heldout)`` with ids ``train-000000``, ... / ``heldout-000000``, ...;
      ``metadata["entry"]`` is the generator's entry (question, answer, metadata, as plain
      JSON data), which ``reasoning_gym.get_score_answer_fn`` scores.

    Raises:
      DatasetError: ``name`` is not a reasoning-gym dataset (close names listed), its
        config refuses ``dataset_kwargs``, too few distinct questions exist, or an entry
        has a blank answer (see ``entry_task``).
    """
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        import difflib

        close = difflib.get_close_matches(name, list(DATASETS), n=5, cutoff=0.5)
        raise DatasetError(
            f"{name!r} is not a reasoning-gym dataset"
            + (f"; did you mean {', '.join(close)}?" if close else "")
            + f" ({len(DATASETS)} exist: reasoning_gym.factory.DATASETS)."
        )
    attempts = 10 * heldout_size + 1000
    try:
        train_data = reasoning_gym.create_dataset(
            name, size=max(train_size, 1), seed=seed, **dataset_kwargs
        )
        held_data = reasoning_gym.create_dataset(
            name, size=attempts, seed=seed + train_size, **dataset_kwargs
        )
    except (TypeError, ValueError, AssertionError) as e:
        raise DatasetError(
            f"reasoning-gym dataset {name!r} refuses its settings {dataset_kwargs}: {e}"
        ) from None
    train = [entry_task(f"train-{i:06d}", train_data[i], name, seed + i) for i in range(train_size)]
    seen = {text_key(t.question) for t in train}
    heldout: list[Task] = []
    for i in range(attempts):
        if len(heldout) == heldout_size:
            break
        entry = held_data[i]
        key = text_key(entry["question"])
        if key not in seen:
            seen.add(key)
            heldout.append(
                entry_task(f"heldout-{len(heldout):06d}", entry, name, seed + train_size + i)
            )
    if len(heldout) < heldout_size:
        raise DatasetError(
            f"reasoning-gym {name!r} gave only {len(heldout)} held-out questions not in train "
            f"after {attempts} draws (wanted {heldout_size}) with {dataset_kwargs}; widen its "
            "settings or ask for fewer tasks."
        )
    return train, heldout


def entry_task(
    task_id: str, entry: dict[str, Any], name: str = "", seed: int | None = None
) -> Task:
    """A reasoning-gym entry as a ``Task`` (``metadata["entry"]`` keeps it, JSON-safe).

    An entry whose answer is None (puzzles with many solutions, which the dataset's scorer
    verifies from the entry's metadata: ``rubiks_cube``, ``graph_color``) gets the task
    answer ``""``, which ``answers_match`` never matches; its scorer still decides.

    Raises:
      DatasetError: the entry's answer is blank text or a non-finite float (``name`` and
        ``seed``, the entry's generator seed, are named).
    """
    answer = entry["answer"]
    if answer is not None:
        _, why = _reference(answer)
        if why:
            raise DatasetError(
                f"reasoning-gym {name!r} entry {task_id} (generator seed {seed}) has answer "
                f"{answer!r:.80} ({why}); its scorer would compare answers with nothing. "
                "Change data.seed or data.dataset_kwargs (env.kwargs.dataset_kwargs), or "
                "use another dataset."
            )
    # A JSON round trip turns the generator's tuples into lists, so tasks serialize.
    entry = json.loads(
        json.dumps({k: entry[k] for k in ("question", "answer", "metadata")}, default=str)
    )
    return Task(
        task_id=task_id,
        question=entry["question"],
        answer="" if answer is None else str(answer),
        metadata={"entry": entry},
    )


class _JsonNumber(str):
    """A JSON number's text, as ``json.loads(parse_int=, parse_float=)`` hands it over."""


def _native(value: Any) -> Any:
    return (
        (float(value) if any(c in value for c in ".eE") else int(value))
        if isinstance(value, _JsonNumber)
        else value
    )


def _read_jsonl(path: str, key: str, answer_column: str) -> list[dict[str, Any]]:
    """The JSON objects of a ``.jsonl`` file's non-blank lines; numbers exact (see
    ``read_records``)."""
    if not path.endswith(_EXTENSIONS["jsonl"]):
        raise DatasetError(
            f"{key}={path!r} is not a {'/'.join(_EXTENSIONS['jsonl'])} file, "
            "which data.source='jsonl' reads; set data.source to match the "
            f"file ({', '.join(FILE_SOURCES)})."
        )
    records = []
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not part of row 1.
        with open(path, encoding="utf-8-sig") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line, parse_int=_JsonNumber, parse_float=_JsonNumber)
                except (ValueError, RecursionError) as e:  # RecursionError: nesting too deep
                    raise DatasetError(
                        f"{key}={path!r} cannot be read as jsonl: line {number} "
                        f"is not JSON ({type(e).__name__}: {e})."
                    ) from None
                if not isinstance(record, dict):
                    raise DatasetError(
                        f"{key}={path!r} cannot be read as jsonl: line {number} "
                        f"is a JSON {type(record).__name__}, not an object "
                        "(one row, {\"question\": ..., \"answer\": ...})."
                    )
                converted = {}
                for k, v in record.items():
                    try:
                        converted[k] = v if k == answer_column else _native(v)
                    except ValueError:  # an integer past Python's 4300-digit conversion limit
                        converted[k] = str(v)
                records.append(converted)
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{key}={path!r} cannot be read as jsonl: {e}") from None
    return records


def _read_parquet(path: str, key: str) -> pa.Table:
    if not path.endswith(_EXTENSIONS["parquet"]):
        raise DatasetError(
            f"{key}={path!r} is not a {'/'.join(_EXTENSIONS['parquet'])} file, "
            "which data.source='parquet' reads; set data.source to match the "
            f"file ({', '.join(FILE_SOURCES)})."
        )
    try:
        import pyarrow.parquet as pq

        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DatasetError(f"{key}={path!r} cannot be read as parquet: {e}") from None


def _shards(spec: DatasetSpec) -> list[str]:
    """The split's shard files in a folder (see the module doc for the naming)."""
    exts = _EXTENSIONS[spec.source]
    files = sorted(
        f
        for f in glob.glob(os.path.join(spec.path, "**", "*"), recursive=True)
        if f.endswith(exts) and os.path.isfile(f)
    )
    found = {}
    for f in files:
        rel = os.path.relpath(f, spec.path).split(os.sep)
        stem = rel[-1]
        for ext in exts:
            stem = stem.removesuffix(ext)
        name = stem.split("-", 1)[0] if "-" in stem else stem
        found.setdefault(name, []).append(f)
        for folder in rel[:-1]:
            found.setdefault(folder, []).append(f)
    chosen = sorted(set(found.get(spec.split, [])))
    if not chosen:
        splits = sorted(name for name in found if name)
        raise DatasetError(
            f"{spec.key}={spec.path!r} holds no {'/'.join(exts)} shards of split "
            f"{spec.split!r}; splits found: {splits or 'none'}. Set data.split (or "
            "data.heldout_split) to one of them."
        )
    return chosen


def _read_saved_dataset(spec: DatasetSpec) -> pa.Table:
    """A ``save_to_disk`` folder: a DatasetDict's split sub-folder, or a Dataset."""
    path = spec.path
    if os.path.isfile(path):
        raise DatasetError(
            f"{spec.key}={path!r} is a file; data.source='hf' reads a folder "
            "written by datasets' save_to_disk."
        )
    dict_file = os.path.join(path, "dataset_dict.json")
    if os.path.exists(dict_file):
        with open(dict_file) as f:
            splits = json.load(f).get("splits", [])
        if spec.split not in splits:
            raise DatasetError(
                f"{spec.key}={path!r} has no split {spec.split!r}; its splits "
                f"are {splits}. Set data.split (or data.heldout_split)."
            )
        path = os.path.join(path, spec.split)
    state_file = os.path.join(path, "state.json")
    files = []
    if os.path.exists(state_file):
        with open(state_file) as f:
            files = [os.path.join(path, d["filename"]) for d in json.load(f).get("_data_files", [])]
    files = files or sorted(glob.glob(os.path.join(path, "*.arrow")))
    if not files:
        raise DatasetError(
            f"{spec.key}={path!r} holds no .arrow files (nor dataset_dict.json): it is not a "
            "folder written by save_to_disk. For parquet or JSONL shards use data.source="
            "parquet or jsonl."
        )
    tables = []
    for file in files:
        try:
            with pa.memory_map(file) as source:
                try:
                    tables.append(pa.ipc.open_stream(source).read_all())
                except pa.ArrowInvalid:  # the file (random-access) format
                    tables.append(pa.ipc.open_file(source).read_all())
        except (pa.ArrowInvalid, OSError) as e:
            raise DatasetError(f"{file!r} cannot be read as Arrow: {e}") from None
    return pa.concat_tables(tables, promote_options="default")
