"""Prompt loading, the synthetic task, and rewards."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qurl_mcore.tasks import addition_examples, load_examples, math_reward, score_all
from qurl_mcore.tasks.rewards import first_number_reward


def test_gsm8k_jsonl_keeps_only_the_final_answer(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "Tom has 3 apples...", "answer": "He has 3*24 = 72 apples.\n#### 1,072"},
            {"question": "What is 2+2?", "answer": "4"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ex = load_examples(path, instruction=" Think step by step.", system_prompt="You are a math tutor.")
    assert [e.answer for e in ex] == ["1072", "4"]
    assert ex[0].messages == ({"role": "system", "content": "You are a math tutor."},
                              {"role": "user", "content": "Tom has 3 apples... Think step by step."})


def test_null_answers_and_empty_prompts_are_bad_rows(tmp_path):
    """A null answer would become the answer "None"; an empty prompt asks nothing."""
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": None}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: the answer \('answer'\) is null"):
        load_examples(path)
    path.write_text(json.dumps({"question": "q", "answer": " "}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: the answer \('answer'\) is empty"):
        load_examples(path)
    path.write_text(json.dumps({"question": "", "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: the prompt is empty"):
        load_examples(path)
    path.write_text(json.dumps({"question": [{"role": "user", "content": ""}], "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: every message of the prompt is empty"):
        load_examples(path)


def test_parquet_with_chat_prompts(tmp_path):
    path = tmp_path / "math.parquet"
    table = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "Compute 1/2+1/4."}], "solution": "3/4"}])
    pq.write_table(table, path)
    (ex,) = load_examples(path, prompt_key="prompt", answer_key="solution")
    assert ex.messages == ({"role": "user", "content": "Compute 1/2+1/4."},) and ex.answer == "3/4"


def test_bad_prompt_files_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_examples(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_examples(bad)
    keys = tmp_path / "keys.jsonl"
    keys.write_text('{"question": "q", "answer": "1"}\n\n{"problem": "q", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"keys.jsonl:3 has no \['question'\] .*set data.prompt_key"):
        load_examples(keys)
    assert len(load_examples(keys, limit=1)) == 1  # a sample check reads only the first rows
    rows = tmp_path / "rows.jsonl"
    rows.write_text('[1, 2]\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:1: a row must be an object"):
        load_examples(rows)
    rows.write_text('{"question": "q", "answer": "1"}\n{"question": 7, "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: the prompt must be a string or a list"):
        load_examples(rows)
    with pytest.raises(ValueError, match="use .jsonl or .parquet"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_examples(tmp_path / "x.csv")


def test_addition_examples_are_deterministic_and_correct():
    a, b = addition_examples(50, seed=3), addition_examples(50, seed=3)
    assert a == b and addition_examples(50, seed=4) != a
    for ex in a:
        x, y = [int(t) for t in ex.messages[0]["content"].split("?")[0].removeprefix("What is ").split(" + ")]
        assert ex.answer == str(x + y) and 0 <= x <= 9 and 0 <= y <= 9


@pytest.mark.parametrize("response,answer,want", [
    ("The answer is \\boxed{72}.", "72", 1.0),
    ("so we get 0.5", "\\frac{1}{2}", 1.0),
    ("I think it's 71", "72", 0.0),
    ("no idea", "72", 0.0),
])
def test_math_reward(response, answer, want):
    assert math_reward(response, answer) == want


def test_first_number_reward():
    assert first_number_reward("7", "7") == 1.0
    assert first_number_reward(" 12 apples", "12") == 1.0
    assert first_number_reward("3 + 4 = 7", "7") == 0.0  # the first number counts: the task asks for just the number
    assert first_number_reward("seven", "7") == 0.0


def test_a_raising_reward_scores_zero_and_is_counted():
    def flaky(response, answer):
        if response == "boom":
            raise RuntimeError("parser crashed")
        return float("nan") if response == "nan" else 1.0

    scores, stats = score_all(flaky, ["ok", "boom", "nan", "ok"], ["1"] * 4)
    assert scores == [1.0, 0.0, 0.0, 1.0]
    assert stats.errors == 2 and "RuntimeError: parser crashed" in stats.messages[0]
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        score_all(flaky, ["a", "b"], ["1"])
