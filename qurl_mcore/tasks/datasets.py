"""Prompt sets: one `Example` per prompt, from JSONL or Parquet files in GSM8K/MATH style."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

#: GSM8K puts the final answer after "#### "; the reasoning before it is not the ground truth.
_GSM8K_FINAL = re.compile(r"####\s*(.+?)\s*$", re.S)


@dataclass(frozen=True)
class Example:
    """A chat prompt (list of {"role", "content"} messages) and the ground-truth answer the reward checks."""

    messages: tuple[dict, ...]
    answer: str


def _field(row: dict, key: str):
    """row[key]; a dotted key not in the row itself (`reward_model.ground_truth`, verl's layout) goes down
    through nested objects. Raises KeyError naming the part that is missing and what is there instead."""
    if key in row:
        return row[key]
    value, path = row, []
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            where = ".".join(path) or "the row"
            has = sorted(value) if isinstance(value, dict) else type(value).__name__
            raise KeyError(f"no {key!r} ({where} has {has})")
        value, path = value[part], [*path, part]
    return value


def _answer(where: str, key: str, raw) -> str:
    """The ground truth as the text a reward compares against: a string (GSM8K's "... #### 72" keeps only the
    final answer), a number, or verl's reward-model object {"ground_truth": ..., "style": ...}. Anything else
    (a list, another object, true/false, null) is refused: its text would never match a reply."""
    if isinstance(raw, dict) and "ground_truth" in raw:  # verl's `reward_model` column
        return _answer(where, f"{key}.ground_truth", raw["ground_truth"])
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        shown = json.dumps(raw)[:80] if raw is not None else "null"
        hint = (f"; name the field that holds it, e.g. data.answer_key={key}.{next(iter(raw))}"
                if isinstance(raw, dict) and raw else "")
        raise ValueError(f"{where}: the answer ({key!r}) is {shown}, not a string or a number; every prompt "
                         f"needs the one answer its reward checks{hint}")
    text = str(raw)
    match = _GSM8K_FINAL.search(text)
    answer = match.group(1).replace(",", "") if match else text.strip()
    if not answer:
        raise ValueError(f"{where}: the answer ({key!r}) is empty")
    return answer


def _rows(path: Path, limit: int | None) -> Iterator[tuple[str, object, str | None]]:
    """(where, row, problem) for the file's rows, streamed, the first `limit` only if given; `where` is path:line
    or path row N; `problem` says why a line is no row (its JSON is broken), and the rows after it still come."""
    if path.suffix == ".jsonl":
        with path.open() as f:
            count = 0
            for number, line in enumerate(f, 1):
                if limit is not None and count >= limit:
                    return
                if line.strip():
                    count += 1
                    try:
                        yield f"{path}:{number}", json.loads(line), None
                    except json.JSONDecodeError as err:
                        yield f"{path}:{number}", None, (f"{path}:{number}: not valid JSON ({err.msg}); each line "
                                                         "must be one object")
        return
    if path.suffix == ".parquet":
        # pyarrow only for .parquet data: `qurl --help` imports this package
        import pyarrow.parquet as pq

        start = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=limit or 1024):
            for index, row in enumerate(batch.to_pylist(), start):
                yield f"{path} row {index}", row, None
            if limit:
                return
            start += batch.num_rows
        return
    raise ValueError(f"{path}: unsupported prompt file type {path.suffix!r}; use .jsonl or .parquet")


def _messages(where: str, prompt, instruction: str) -> list[dict]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{where}: the prompt is empty")
        return [{"role": "user", "content": f"{prompt}{instruction}"}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                   for m in prompt):
        if not any(isinstance(m["content"], str) and m["content"].strip() for m in prompt):
            raise ValueError(f"{where}: every message of the prompt is empty")
        return [dict(m) for m in prompt]
    raise ValueError(f"{where}: the prompt must be a string or a list of {{role, content}} messages, "
                     f"got {type(prompt).__name__} {str(prompt)[:80]!r}")


def _example(where: str, row, prompt_key: str, answer_key: str, system_prompt: str | None,
             instruction: str) -> Example:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be an object with {prompt_key!r} and {answer_key!r}, "
                         f"got {type(row).__name__}")
    found, missing = [], []
    for key in (prompt_key, answer_key):
        try:
            found.append(_field(row, key))
        except KeyError as err:
            missing.append(err.args[0])
    if missing:
        raise ValueError(f"{where} has {', '.join(missing)}; set data.prompt_key / data.answer_key to the file's "
                         "keys (a nested one as reward_model.ground_truth)")
    prompt, answer = found
    messages = _messages(where, prompt, instruction)
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return Example(tuple(messages), _answer(where, answer_key, answer))


def prompt_file_problem(path: str | Path) -> str | None:
    """Why `path` is no prompt file to read, or None."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p.name for p in path.iterdir() if p.suffix in (".jsonl", ".parquet"))[:4]
        return (f"{path} is a directory; give one .jsonl or .parquet file"
                + (f" (it holds {', '.join(files)})" if files else ""))
    if not path.is_file():
        return f"{path} does not exist"
    return None


def scan_examples(path: str | Path, *, prompt_key: str = "question", answer_key: str = "answer",
                  system_prompt: str | None = None, instruction: str = "",
                  limit: int | None = None) -> Iterator[tuple[str, Example | str]]:
    """(where, example) for each row of a prompt file, streamed; a bad row gives (where, what is wrong with
    it, naming file and line) and the scan goes on. `load_examples` says what the rows hold."""
    path = Path(path)
    problem = prompt_file_problem(path)
    if problem:
        raise FileNotFoundError(f"prompt file {problem}")
    for where, row, problem in _rows(path, limit):
        if problem is None:
            try:
                yield where, _example(where, row, prompt_key, answer_key, system_prompt, instruction)
                continue
            except ValueError as err:
                problem = str(err)
        yield where, problem


def load_examples(path: str | Path, *, prompt_key: str = "question", answer_key: str = "answer",
                  system_prompt: str | None = None, instruction: str = "",
                  limit: int | None = None) -> list[Example]:
    """Read prompts and answers (the first `limit` rows only, if given: a quick check of a file). `prompt_key`
    may hold a string (the user turn; `instruction` is appended) or a list of chat messages; GSM8K-style
    answers ("... #### 72") keep only the final answer. A key may be dotted, into nested objects (verl's
    `reward_model.ground_truth`; `reward_model` alone takes its ground_truth). A bad row (broken JSON, a key
    missing, an empty prompt, an answer that is null, empty, or no string or number) raises ValueError naming
    file and line."""
    examples = []
    for _, example in scan_examples(path, prompt_key=prompt_key, answer_key=answer_key,
                                    system_prompt=system_prompt, instruction=instruction, limit=limit):
        if isinstance(example, str):
            raise ValueError(example)
        examples.append(example)
    if not examples:
        raise ValueError(f"{path} holds no prompts")
    return examples


def chat_ids(tokenizer, example: Example, system_prompt: str = "") -> list[int]:
    """Token ids of `example`'s chat (after `system_prompt`, when set) with the assistant turn opened, by the
    model's chat template (`tokenizer`: a Hugging Face tokenizer)."""
    messages = [dict(m) for m in example.messages]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
