"""The typed actor groups (loop/groups.py) over stand-ins of Ray actor handles made from the real actor
classes: each group method reaches an actor method that exists, with arguments its signature takes (as Ray
checks them), and a rank's or the manager's failure becomes the RunFailure or EngineFailure the driver
expects. A renamed or re-signed actor method fails here, not in the middle of a run."""
from __future__ import annotations

import inspect
import time

import pytest
import ray
import torch
from ray.exceptions import ActorDiedError, RayTaskError

from qurl_mcore.loop.batch import Sample, collate
from qurl_mcore.loop.groups import Rollouts, TrainerGroup
from qurl_mcore.loop.outcome import RunFailure
from qurl_mcore.loop.sampler import EngineFailure, EngineHost, RolloutManager
from qurl_mcore.loop.trainer import PolicyTrainer

LOGS = "runs/x/logs"
HANG_S = 30.0


class Ref:
    """A remote call: its value, or the error `ray.get` raises; a `hung` one never finishes."""

    def __init__(self, value=None, error: Exception | None = None, hung: bool = False, waits: int = 0):
        self.value, self.error, self.hung = value, error, hung
        self.waits = waits  # the `ray.wait` calls that pass before it finishes (a slow call)


class Handle:
    """What a Ray actor handle of `cls` offers: its public methods, each with `.remote(*args, **kwargs)`, which
    binds the arguments to the method's signature (a TypeError otherwise, as Ray raises), records the call in
    `calls` and returns `answer(method name)`."""

    def __init__(self, cls: type, calls: list[str], answer):
        self._cls, self._calls, self._answer = cls, calls, answer

    def __getattr__(self, name: str):
        method = getattr(self._cls, name, None)
        if name.startswith("_") or not inspect.isfunction(method):
            raise AttributeError(f"{self._cls.__name__} has no method {name!r}")
        signature = inspect.signature(method)

        class Method:
            @staticmethod
            def remote(*args, **kwargs) -> Ref:
                signature.bind(None, *args, **kwargs)
                self._calls.append(name)
                return self._answer(name)

        return Method


@pytest.fixture
def fake_ray(monkeypatch):
    """`ray.wait`, `ray.get` and `ray.kill` over `Ref`s: calls finish in the order they were made, a hung one
    never (a wait on it without a timeout fails the test instead of hanging it). Returns the waits made, as
    (refs waited on, num_returns, timeout)."""
    waits = []

    def wait(refs, num_returns=1, timeout=None):
        waits.append((len(refs), num_returns, timeout))
        done = [ref for ref in refs if not ref.hung and ref.waits <= 0][:num_returns]
        for ref in refs:
            ref.waits -= 1
        if len(done) < num_returns and timeout is None:
            raise AssertionError("ray.wait without a timeout on a call that never ends")
        return done, [ref for ref in refs if ref not in done]

    def get(ref, timeout=None):
        if ref.hung:
            if timeout is None:
                raise AssertionError("ray.get without a timeout on a call that never ends")
            raise ray.exceptions.GetTimeoutError()
        if ref.error is not None:
            raise ref.error
        return ref.value

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda actor: None)
    return waits


ANSWERS = {"push_weights": {"time/push": 2.0, "push/bytes": 100.0, "push/verified_units": 4.0},
           "push_reference": 3.0, "quantized_linears": {"model.layers.0.mlp.up_proj"},
           "step": {"loss/total": 0.5}, "open_weight_group": "10.0.0.1:2345", "export_hf": "ckpt/hf", "pid": 7,
           "save_checkpoint": {"file": "rank.pt"}, "finish_checkpoint": [],
           "endpoints": [("http://10.0.0.2:30000", "key")], "reference_endpoint": ("http://127.0.0.1:30001", "key"),
           "pids": [11],
           "generate": ([], {"reward/mean": 1.0}), "evaluate": {"eval/accuracy": 1.0}}

BATCH = collate([Sample([1], [2], [-0.5], reward=1.0, group=0)], torch.tensor([1.0]), pad_id=0)

# every public group method, called as the driver calls it -> the actor method it forwards to
TRAINER_CALLS = {
    "connect_engines": (([("http://h:1", "k")],), {}, "connect_engines"),
    "open_weight_group": (("qurl-weights-1",), {"backend": "gloo", "timeout": 120.0}, "open_weight_group"),
    "close_weight_group": ((), {}, "close_weight_group"),
    "quantized_linears": ((), {}, "quantized_linears"),
    "push_weights": (("step-1",), {"only": [0]}, "push_weights"),
    "push_reference": ((("http://h:1", "k"), "step-1"), {}, "push_reference"),
    "step": ((BATCH,), {}, "step"),
    "empty_cache": ((), {}, "empty_cache"),
    "save_checkpoint": (("ckpt", 3), {}, "save_checkpoint"),
    "finish_checkpoint": ((), {}, "finish_checkpoint"),
    "load_checkpoint": (("ckpt/step_00000003",), {}, "load_checkpoint"),
    "export_hf": (("ckpt/hf",), {}, "export_hf"),
    "pids": ((), {}, "pid"),
    "close": ((), {}, "close"),
}
ROLLOUT_CALLS = {
    "endpoints": ((), {}, "endpoints"),
    "reference_endpoint": ((), {}, "reference_endpoint"),
    "quantized_linears": ((), {}, "quantized_linears"),
    "generate": ((3,), {}, "generate"),
    "evaluate": ((3,), {"reference": True}, "evaluate"),
    "release_memory": ((), {"reference": True}, "release_memory"),
    "resume_memory": ((["weights"],), {"reference": True}, "resume_memory"),
    "pids": ((), {}, "pids"),
    "restart": ((0,), {}, "restart"),
}


def _public(cls: type) -> set[str]:
    return {name for name, f in vars(cls).items() if inspect.isfunction(f) and not name.startswith("_")}


def _trainers(world: int, calls: list[str], answer=lambda name: Ref(ANSWERS.get(name))) -> TrainerGroup:
    return TrainerGroup([Handle(PolicyTrainer, calls, answer) for _ in range(world)], LOGS, HANG_S)


def _rollouts(calls: list[str], host_answer=lambda name: Ref(ANSWERS.get(name)),
              answer=lambda name: Ref(ANSWERS.get(name))) -> Rollouts:
    hosts = [Handle(EngineHost, calls, host_answer) for _ in range(2)]
    return Rollouts(Handle(RolloutManager, calls, answer), hosts, LOGS, HANG_S)


def test_every_trainer_group_method_reaches_its_trainer_method_on_every_rank(fake_ray):
    assert set(TRAINER_CALLS) == _public(TrainerGroup)
    for method, (args, kwargs, target) in TRAINER_CALLS.items():
        calls: list[str] = []
        getattr(_trainers(2, calls), method)(*args, **kwargs)
        assert calls == [target, target], method
    calls = []
    group = _trainers(3, calls)
    assert len(group) == 3
    # the slowest rank's time, all ranks' bytes and verified units
    assert group.push_weights("step-1") == {"time/push": 2.0, "push/bytes": 300.0, "push/verified_units": 12.0}
    assert group.pids() == [7, 7, 7]
    assert group.open_weight_group("g", backend="gloo", timeout=1.0) == "10.0.0.1:2345"
    assert group.step(BATCH) == {"loss/total": 0.5} and group.export_hf("out") == "ckpt/hf"
    assert group.save_checkpoint("ckpt", 1) == [{"file": "rank.pt"}] * 3
    assert group.quantized_linears() == {"model.layers.0.mlp.up_proj"}


def test_every_rollouts_method_reaches_its_manager_method(fake_ray):
    assert set(ROLLOUT_CALLS) | {"close"} == _public(Rollouts)
    for method, (args, kwargs, target) in ROLLOUT_CALLS.items():
        calls: list[str] = []
        getattr(_rollouts(calls), method)(*args, **kwargs)
        assert calls[-1] == target and calls.count(target) == 1, method
    calls = []
    rollouts = _rollouts(calls)
    rollouts.close()
    assert calls == ["shutdown", "shutdown"]  # each host stops its server
    assert rollouts.endpoints() == ANSWERS["endpoints"] and rollouts.urls == ["http://10.0.0.2:30000"]


def test_a_renamed_or_resigned_actor_method_fails_at_the_call(fake_ray):
    trainer = Handle(PolicyTrainer, [], lambda name: Ref())
    with pytest.raises(AttributeError, match="no method 'push_weight'"):
        trainer.push_weight.remote("v")
    with pytest.raises(TypeError):
        trainer.push_weights.remote("v", engines=[0])
    with pytest.raises(TypeError):  # the manager's flags are keywords
        Handle(RolloutManager, [], lambda name: Ref()).evaluate.remote(3, True)


def test_a_failed_rank_ends_the_run_naming_it_and_an_engine_failure_passes_through(fake_ray):
    def rank_1_fails(error):
        answers = iter([Ref(1.0), Ref(error=error)])
        return lambda name: next(answers)

    # the ranks' handles share one answer stream: rank 0 answers first, rank 1 second
    answer = rank_1_fails(RayTaskError("push_weights", "tb", ValueError("bad\nmore")))
    group = TrainerGroup([Handle(PolicyTrainer, [], answer) for _ in range(2)], LOGS, HANG_S)
    with pytest.raises(RunFailure) as failure:
        group.push_weights("step-1")
    assert str(failure.value) == f"trainer rank 1 failed in push_weights: ValueError: bad; see {LOGS}/trainer-1.log"
    answer = rank_1_fails(ActorDiedError())
    group = TrainerGroup([Handle(PolicyTrainer, [], answer) for _ in range(2)], LOGS, HANG_S)
    with pytest.raises(RunFailure, match=f"trainer rank 1 failed in pid: .*; see {LOGS}/trainer-1.log"):
        group.pids()
    answer = rank_1_fails(RayTaskError("push_weights", "tb", EngineFailure(1, "refused")))
    group = TrainerGroup([Handle(PolicyTrainer, [], answer) for _ in range(2)], LOGS, HANG_S)
    with pytest.raises(EngineFailure) as engine:
        group.push_weights("step-1")
    assert engine.value.index == 1 and engine.value.reason == "refused"


def test_a_failed_manager_ends_the_run_and_an_engine_failure_passes_through(fake_ray):
    rollouts = _rollouts([], answer=lambda name: Ref(error=RayTaskError(name, "tb", KeyError("x"))))
    with pytest.raises(RunFailure) as failure:
        rollouts.generate(3)
    assert str(failure.value) == (f"the rollout manager failed in generate: KeyError: 'x'; see "
                                  f"{LOGS}/rollout-manager.log")
    rollouts = _rollouts([], answer=lambda name: Ref(error=RayTaskError(name, "tb", EngineFailure(0, "gone"))))
    with pytest.raises(EngineFailure) as engine:
        rollouts.resume_memory(["weights"])
    assert engine.value.index == 0


def test_restart_names_the_node_of_an_engine_whose_host_died(fake_ray):
    calls: list[str] = []
    rollouts = _rollouts(calls, host_answer=lambda name: Ref(error=ActorDiedError()))
    rollouts.endpoints()
    with pytest.raises(RunFailure, match="rollout engine 0 is gone with its host on node 10.0.0.2: .*; bring the "
                                         "node back into the Ray cluster"):
        rollouts.restart(0)
    assert "restart" not in calls
    calls.clear()  # a host that answers with its engine's error is there: its engine restarts
    rollouts = _rollouts(calls, host_answer=lambda name: Ref(error=RayTaskError(name, "tb", AttributeError("x"))))
    rollouts.restart(1)
    assert calls == ["pid", "restart"]


def test_a_rank_that_never_answers_ends_the_run_naming_it(fake_ray):
    answers = iter([Ref({"loss/total": 0.5}), Ref(hung=True), Ref({"loss/total": 0.5})])
    group = TrainerGroup([Handle(PolicyTrainer, [], lambda name: next(answers)) for _ in range(3)], LOGS, HANG_S)
    with pytest.raises(RunFailure) as failure:
        group.step(BATCH)
    assert str(failure.value) == (f"trainer rank 1 hung in step: no answer 30 s after rank(s) 0, 2 answered "
                                  f"(train.hang_timeout_s); see {LOGS}/trainer-1.log")


def test_the_export_waits_for_rank_0_writing_the_model_alone(fake_ray, monkeypatch):
    """Rank 0 writes the model after the others are done, longer than the hang timeout allows between ranks."""
    clock = iter(range(0, 10_000, 100))  # each look at the clock: 100 s later
    monkeypatch.setattr(time, "monotonic", lambda: float(next(clock)))
    answers = iter([Ref("ckpt/hf", waits=5), Ref(None)])
    group = TrainerGroup([Handle(PolicyTrainer, [], lambda name: next(answers)) for _ in range(2)], LOGS, HANG_S)
    assert group.export_hf("ckpt/hf") == "ckpt/hf"


def test_a_host_ray_cannot_reach_is_waited_for_a_bounded_time(fake_ray):
    calls: list[str] = []
    unavailable = ray.exceptions.ActorUnavailableError("unreachable", None)
    hosts = [Handle(EngineHost, calls, lambda name: Ref(error=unavailable))]
    rollouts = Rollouts(Handle(RolloutManager, calls, lambda name: Ref()), hosts, LOGS, unreachable_timeout=0.5)
    with pytest.raises(RunFailure, match=r"rollout engine 0's host on node \? did not answer for 0.5 s "
                                         r"\(rollout.unreachable_timeout_s\)"):
        rollouts.restart(0)
    assert "restart" not in calls and calls.count("pid") >= 1
    hosts = [Handle(EngineHost, calls, lambda name: Ref(hung=True))]  # a host that never answers at all
    rollouts = Rollouts(Handle(RolloutManager, calls, lambda name: Ref()), hosts, LOGS, unreachable_timeout=0.5)
    with pytest.raises(RunFailure, match="did not answer for 0.5 s"):
        rollouts.restart(0)


def test_actors_close_together_within_one_bound(fake_ray):
    """Every actor's stop is asked for at once and waited for together, `timeout` in all, also when some
    never answer; then every actor is killed."""
    killed = []
    ray.kill = killed.append  # fake_ray's monkeypatch restores it
    answers = iter([Ref(), Ref(hung=True), Ref(hung=True)])
    group = TrainerGroup([Handle(PolicyTrainer, [], lambda name: next(answers)) for _ in range(3)], LOGS, HANG_S)
    group.close()
    assert fake_ray == [(3, 3, HANG_S)] and killed == group.actors


def test_a_stop_whose_grace_passed_ends_the_wait_on_a_busy_rank(fake_ray):
    """SIGTERM during a long step: once checkpoint.stop_grace_s has passed, the wait on a rank still in the
    step ends (the run exits without that step) instead of lasting until the step ends."""
    import signal

    from qurl_mcore.loop.outcome import StopOverdue, StopRequest

    stop = StopRequest(signals=(), grace_s=0.0)
    answers = iter([Ref(hung=True), Ref(hung=True)])
    group = TrainerGroup([Handle(PolicyTrainer, [], lambda name: next(answers)) for _ in range(2)], LOGS, HANG_S,
                         stop)
    stop._on_signal(signal.SIGTERM, None)
    with pytest.raises(StopOverdue, match="SIGTERM 0 s ago and the step in progress has not ended"):
        group.step(BATCH)
    rollouts = Rollouts(Handle(RolloutManager, [], lambda name: Ref(hung=True)), [], LOGS, HANG_S, stop)
    with pytest.raises(StopOverdue):
        rollouts.generate(3)
