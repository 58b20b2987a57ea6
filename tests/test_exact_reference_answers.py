"""A reference answer is the one the dataset file writes, digit for digit, and one that
only looks like text (LaTeX spacing, blank-rendering characters) is no answer.

Arrow's JSON reader turned ``12345678901234567890`` into ``12345678901234567168`` (a
float64), and any integer of a column that mixes 4 and 2.5 the same way past 2^53: the
policy was then rewarded for the wrong number. Parquet and saved datasets cannot say what
a float64 past 2^53 was written as, so such a cell is refused by row and column."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytunix.data.answers import answers_match, blank_answer
from raytunix.data.datasets import DatasetError, DatasetSpec, load_tasks

EXACT = [
    "12345678901234567890",
    "9007199254740993",
    "-9007199254740993",
    "123456789012345678901234567890",
    "2.50",
    "1e30",
    "0.1000000000000000055511151231257827",
]


def _jsonl(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return DatasetSpec("jsonl", str(path))


@pytest.mark.parametrize("number", EXACT)
def test_a_jsonl_number_answer_is_kept_as_written(tmp_path, number):
    spec = _jsonl(
        tmp_path / "rows.jsonl",
        [f'{{"question": "q{i}?", "answer": {n}}}' for i, n in enumerate([number, "2.5", "4"])],
    )
    tasks = load_tasks(spec)
    assert tasks[0].answer == number
    assert answers_match(number, tasks[0].answer)
    if number.isdigit() and len(number) > 16:  # the float64 of it is a different integer
        assert not answers_match(str(int(float(number))), tasks[0].answer)


def test_a_jsonl_answer_column_may_mix_numbers_and_text(tmp_path):
    spec = _jsonl(
        tmp_path / "rows.jsonl",
        [
            '{"question": "a?", "answer": 4}',
            '{"question": "b?", "answer": "x + 1"}',
            '{"question": "c?", "answer": 2.5, "level": 3, "weight": 0.5}',
        ],
    )
    tasks = load_tasks(spec)
    assert [t.answer for t in tasks] == ["4", "x + 1", "2.5"]
    # Other columns keep their JSON types in the task's metadata.
    assert tasks[2].metadata["columns"] == {"level": 3, "weight": 0.5}


def test_shards_of_a_jsonl_folder_keep_exact_numbers(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train-00000.jsonl").write_text(
        '{"question": "a?", "answer": 12345678901234567891}\n'
    )
    (folder / "train-00001.jsonl").write_text('{"question": "b?", "answer": "seven"}\n')
    tasks = load_tasks(DatasetSpec("jsonl", str(folder)))
    assert sorted(t.answer for t in tasks) == ["12345678901234567891", "seven"]


@pytest.mark.parametrize("line", ['[1, 2]', '"just text"', '7'])
def test_a_jsonl_line_that_is_not_an_object_is_named(tmp_path, line):
    spec = _jsonl(tmp_path / "rows.jsonl", ['{"question": "a?", "answer": 1}', "", line])
    with pytest.raises(
        DatasetError,
        match=r"cannot be read as jsonl: line 3 is a JSON \w+, not "
        r"an object",
    ):
        load_tasks(spec)


def test_a_parquet_float64_past_2_53_is_refused_by_row_and_column(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(
        pa.table(
            {"question": ["a?", "b?", "c?"], "answer": [2.5, 1.2345678901234567e19, float(2**53)]}
        ),
        path,
    )
    with pytest.raises(DatasetError) as e:
        load_tasks(DatasetSpec("parquet", str(path)))
    assert "row 1: answer column 'answer'" in str(e.value)
    assert "float64 at or past 2^53" in str(e.value)
    assert "2 of the 3 rows have none (rows 1, 2)" in str(e.value)  # 2^53 + 1 reads as 2^53


BLANK_LOOKING = [
    "\\text{}",
    "\\text{ }",
    "\\mathrm{}",
    "\\quad",
    "\\qquad~",
    "~",
    "$\\,$",
    "\\; \\!",
    "\\hspace{1cm}",
    "\\phantom{x}",
    "\\left(\\right)",
    "\\boxed{\\quad}",
    "\u3164",
    "\u2800",
    "\uffa0",
    "\u115f",
    "\u1160",
    "$\u3164$",
    "#### \\text{}",
    # the trial's second list: skips, breaks, struts, switches, colours, fonts
    "\\hfill",
    "\\vfill",
    "\\bigskip",
    "\\newline",
    "\\linebreak",
    "\\space",
    "\\nobreakspace",
    "\\null",
    "\\relax",
    "\\strut",
    "\\mathstrut",
    "\\mskip{3mu}",
    "\\mspace{3mu}",
    "\\kern 2pt",
    "\\kern1em",
    "\\hskip 1em",
    "\\phantom{\\frac{1}{2}}",
    "\\hphantom{\\frac{a}{b}}",
    "\\phantom{{}}",
    "\\textnormal{}",
    "\\texttt{}",
    "\\emph{}",
    "\\mathbb{}",
    "\\mathcal{}",
    "\\boldsymbol{}",
    "\\bm{}",
    "\\mathord{}",
    "\\scriptstyle",
    "\\tiny",
    "\\color{white}",
    "\\textcolor{white}{}",
    "\U0001d159",
    "work #### \\hfill",
]
NOT_BLANK = [
    "\\pi",
    "\\text{yes}",
    "\\emptyset",
    "~5",
    "\\infty",
    "\\left(1\\right)",
    "\\mathbb{R}",
    "\\rightarrow",
    "\\quadrature",
    "\\textbackslash",
    "\u3164x",
    "\\textcolor{red}{5}",
    "\\color{red}5",
    "\\kern2pt x",
    "\\small 5",
    "\\nullset",
    "\\mathcal{O}(n)",
    "\\overline{AB}",
    "1 \\quad 2",
]


@pytest.mark.parametrize("reference", BLANK_LOOKING)
def test_latex_space_and_blank_rendering_characters_are_no_reference(tmp_path, reference):
    if "####" not in reference:  # GSM8K layout: the loader reads the text after the mark
        assert blank_answer(reference)
        for answer in ("", " ", reference, "\u3164", "\\quad", "0"):
            assert not answers_match(answer, reference)
    path = tmp_path / "rows.jsonl"
    path.write_text(
        json.dumps({"question": "a?", "answer": "4"})
        + "\n"
        + json.dumps({"question": "b?", "answer": reference})
        + "\n"
    )
    with pytest.raises(DatasetError, match="row 1: answer column 'answer'"):
        load_tasks(DatasetSpec("jsonl", str(path)))


@pytest.mark.parametrize("reference", NOT_BLANK)
def test_latex_with_content_is_still_a_reference(reference):
    assert not blank_answer(reference)
    assert answers_match(reference, reference)


@pytest.mark.parametrize(
    "kind, exact, past", [(pa.float32(), 16777215.0, 16777217.0), (pa.float16(), 2047.0, 2049.0)]
)
def test_a_narrow_float_column_gives_the_shortest_text_and_refuses_inexact_integers(
    tmp_path, kind, exact, past
):
    path = tmp_path / "rows.parquet"
    pq.write_table(
        pa.table({"question": ["a?", "b?", "c?"], "answer": pa.array([0.1, 2.5, exact], kind)}),
        path,
    )
    # float32 0.1 widened to float64 is 0.10000000149011612: the policy's "0.1" must match.
    assert [t.answer for t in load_tasks(DatasetSpec("parquet", str(path)))] == [
        "0.1",
        "2.5",
        str(int(exact)),
    ]
    pq.write_table(
        pa.table({"question": ["a?", "b?"], "answer": pa.array([0.5, past], kind)}), path
    )
    with pytest.raises(
        DatasetError,
        match=r"row 1: answer column 'answer' .*an integer past "
        r"what its float16/float32 column holds exactly",
    ):
        load_tasks(DatasetSpec("parquet", str(path)))


def test_jsonl_lines_that_python_cannot_convert_are_named_not_raised(tmp_path):
    huge = "9" * 5000  # past Python's 4300-digit int conversion limit
    spec = _jsonl(
        tmp_path / "rows.jsonl",
        [
            f'{{"question": "a?", "answer": 7, "extra": {huge}}}',
            '{"question": "b?", "answer": "6"}',
        ],
    )
    tasks = load_tasks(spec)
    assert tasks[0].answer == "7" and tasks[0].metadata["columns"]["extra"] == huge
    # As an answer it is read too, and refused for its length (never compared), by row.
    as_answer = _jsonl(tmp_path / "answer.jsonl", [f'{{"question": "a?", "answer": {huge}}}'])
    with pytest.raises(DatasetError, match="5000 characters"):
        load_tasks(as_answer)
    deep = _jsonl(
        tmp_path / "deep.jsonl",
        ['{"question": "a?", "answer": "1", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"],
    )
    with pytest.raises(DatasetError, match="line 1 is not JSON .RecursionError"):
        load_tasks(deep)


def test_a_reference_longer_than_answers_are_compared_is_refused(tmp_path):
    long = "x" * 257
    spec = _jsonl(
        tmp_path / "rows.jsonl",
        [
            json.dumps({"question": "a?", "answer": "4"}),
            json.dumps({"question": "b?", "answer": long}),
            json.dumps({"question": "c?", "answer": "work " * 80 + "#### 7"}),
        ],
    )  # 7 is compared
    with pytest.raises(DatasetError, match=r"257 characters, over the 256.*rows 1\b"):
        load_tasks(spec)
    assert not answers_match(long, long)  # why: such a row could never be rewarded
    ok = _jsonl(tmp_path / "ok.jsonl", [json.dumps({"question": "a?", "answer": "x" * 256})])
    assert load_tasks(ok)[0].answer == "x" * 256


def test_a_jsonl_file_with_a_byte_order_mark_reads_its_first_row(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf" + b'{"question": "a?", "answer": 4}\n{"question": "b?", "answer": 5}\n'
    )
    tasks = load_tasks(DatasetSpec("jsonl", str(path)))
    assert [(t.question, t.answer) for t in tasks] == [("a?", "4"), ("b?", "5")]


def test_json_booleans_read_as_written(tmp_path):
    spec = _jsonl(
        tmp_path / "rows.jsonl",
        ['{"question": "a?", "answer": true}', '{"question": "b?", "answer": false}'],
    )
    assert [t.answer for t in load_tasks(spec)] == ["true", "false"]
