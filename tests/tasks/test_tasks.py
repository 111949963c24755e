"""Prompt loading, the synthetic task, and rewards."""
import json
import re

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
    table = pa.Table.from_pylist([{"prompt": [{"role": "user", "content": "Compute 1/2+1/4."}], "solution": "3/4",
                                   "reward_model": {"style": "rule", "ground_truth": "3/4"}}])
    pq.write_table(table, path)
    (ex,) = load_examples(path, prompt_key="prompt", answer_key="solution")
    assert ex.messages == ({"role": "user", "content": "Compute 1/2+1/4."},) and ex.answer == "3/4"
    # verl's parquet files: reward_model is a struct column, read as the object it is
    assert load_examples(path, prompt_key="prompt", answer_key="reward_model.ground_truth") == [ex]


def test_bad_prompt_files_are_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_examples(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "1"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_examples(bad)
    keys = tmp_path / "keys.jsonl"
    keys.write_text('{"question": "q", "answer": "1"}\n\n{"problem": "q", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"keys.jsonl:3 has no 'question' \(the row has \['answer', 'problem'\]\); "
                                         "set data.prompt_key"):
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


def _verl_rows(path, n=3):
    """Rows as verl's data preprocessing writes them (examples/data_preprocess/gsm8k.py): a chat prompt, the
    answer in a reward-model object, and columns the run does not read."""
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + 2?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 2)},
             "extra_info": {"split": "train", "index": i}} for i in range(n)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_verl_layout_nested_keys_and_the_reward_model_object(tmp_path):
    """verl's answer lives in reward_model.ground_truth: named by its dotted key, or by reward_model alone (its
    ground_truth taken, never the object's text); a dotted key that is not there is named with what is."""
    path = _verl_rows(tmp_path / "verl.jsonl")
    nested = load_examples(path, prompt_key="prompt", answer_key="reward_model.ground_truth")
    assert [e.answer for e in nested] == ["2", "3", "4"]
    assert nested[1].messages == ({"role": "user", "content": "What is 1 + 2?"},)
    assert load_examples(path, prompt_key="prompt", answer_key="reward_model") == nested
    with pytest.raises(ValueError, match=r"verl.jsonl:1 has no 'reward_model.truth' \(reward_model has "
                                         r"\['ground_truth', 'style'\]\)"):
        load_examples(path, prompt_key="prompt", answer_key="reward_model.truth")
    with pytest.raises(ValueError, match=r"the answer \('extra_info'\) is \{\"split\": .*not a string or a number.*"
                                         r"data.answer_key=extra_info.split"):
        load_examples(path, prompt_key="prompt", answer_key="extra_info")


@pytest.mark.parametrize("answer,shown", [([4], "[4]"), ({"v": 6}, '{"v": 6}'), (True, "true")])
def test_answers_of_other_types_are_refused_not_turned_into_text(tmp_path, answer, shown):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": answer}) + "\n")
    with pytest.raises(ValueError, match=rf"p.jsonl:1: the answer \('answer'\) is {re.escape(shown)}, not a string "
                                         "or a number"):
        load_examples(path)
    path.write_text(json.dumps({"question": "q", "answer": 72}) + "\n" + json.dumps({"question": "q", "answer": 0.5}))
    assert [e.answer for e in load_examples(path)] == ["72", "0.5"]  # numbers are answers


def test_a_directory_given_as_the_prompt_file_is_named_a_directory(tmp_path):
    _verl_rows(tmp_path / "train.jsonl")
    with pytest.raises(FileNotFoundError, match=rf"{tmp_path} is a directory; give one .jsonl or .parquet file "
                                                r"\(it holds train.jsonl\)"):
        load_examples(tmp_path)


def test_a_chat_prompt_is_the_example_the_same_plain_prompt_is(tmp_path):
    """A list of messages becomes the example a plain prompt's user turn does, so the loop renders both through
    the model's chat template alike (`chat_ids`)."""
    (chat,) = load_examples(_verl_rows(tmp_path / "verl.jsonl", 1), prompt_key="prompt",
                            answer_key="reward_model.ground_truth")
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"question": "What is 0 + 2?", "answer": "2"}) + "\n")
    assert load_examples(plain) == [chat]


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
