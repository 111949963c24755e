"""Reward functions as a user writes them, for `data.reward: tests.tasks.user_rewards:NAME`."""
import asyncio


def exact(response: str, answer: str) -> float:
    if answer == "boom":
        raise RuntimeError("cannot score this one")
    return float(response.strip() == answer)


def numeric(response: str, answer: str) -> float:
    return float(float(response) == float(answer))


def lengths(responses: list[str], answers: list[str]) -> list[float]:
    if "boom" in answers:
        raise RuntimeError("the batch fails as a whole")
    return [min(len(r) / 10, 1.0) for r in responses]


async def exact_async(response: str, answer: str) -> float:
    await asyncio.sleep(0)
    return exact(response, answer)


async def lengths_async(responses: list[str], answers: list[str]) -> list[float]:
    await asyncio.sleep(0)
    return lengths(responses, answers)


def one_argument(response: str) -> float:
    return 1.0


NOT_A_FUNCTION = 3
