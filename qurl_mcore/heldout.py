"""The held-out prompts a config evaluates on (`eval.*`): read before a run starts (`qurl train --check`) and by
the loop's evaluation (`loop/evaluation.py`), never a training prompt."""
from __future__ import annotations

from qurl_mcore.config import Config
from qurl_mcore.tasks import Example, load_examples
from qurl_mcore.tasks.synthetic import held_out_additions


def eval_examples(cfg: Config, train: list[Example]) -> list[Example]:
    """The held-out prompts: the first `eval.num_prompts` rows of `eval.data` (read with the data.* keys), or
    else, for task addition, `eval.num_prompts` additions none of which is a training prompt (`train`).
    Raises ValueError naming the field to fix."""
    e, d = cfg.eval, cfg.data
    if e.data:
        try:
            return load_examples(e.data, prompt_key=d.prompt_key, answer_key=d.answer_key, limit=e.num_prompts)
        except (ValueError, OSError) as err:
            raise ValueError(f"eval.data: {err}") from None
    if d.task != "addition":
        raise ValueError(f"eval.data: task {d.task!r} has no generated held-out split; give held-out prompts in "
                         "a file of their own")
    try:
        return held_out_additions(e.num_prompts, train, seed=cfg.seed, min_operand=d.min_operand,
                                  max_operand=d.max_operand)
    except ValueError as err:
        raise ValueError(f"eval.num_prompts: {err}") from None


def greedy_repeats(cfg: Config) -> str | None:
    """The problem with `eval.n` > 1 greedy samples per prompt (they are all alike), or None."""
    e = cfg.eval
    if e.temperature == 0 and e.n > 1:
        return (f"eval.n: greedy decoding (eval.temperature 0) gives one answer {e.n} times; use eval.n=1, or "
                "eval.temperature > 0 for mean@n")
    return None
