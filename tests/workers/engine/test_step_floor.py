"""FIRSTTOKEN_TEST_STEP_FLOOR_S: a test's lower bound on each step's wall time (the worker-stop tests
need long jobs that are still running at the signal however fast the engine has become)."""

from __future__ import annotations

import pytest

import workers.engine.engine as engine_mod
from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine
from workers.engine.engine import STEP_FLOOR_ENV, step_floor_s


@pytest.mark.parametrize("raw, want", [("", 0.0), ("0", 0.0), ("0.02", 0.02), (" 1.5 ", 1.5)])
def test_step_floor_reads_seconds(monkeypatch, raw, want):
    monkeypatch.setenv(STEP_FLOOR_ENV, raw)
    assert step_floor_s() == want


@pytest.mark.parametrize("raw", ["fast", "-0.1", "11", "nan"])
def test_step_floor_refuses_a_bad_value(monkeypatch, raw):
    monkeypatch.setenv(STEP_FLOOR_ENV, raw)
    with pytest.raises(ValueError, match=STEP_FLOOR_ENV):
        step_floor_s()
    with pytest.raises(ValueError, match=STEP_FLOOR_ENV):  # at the engine's start, not at a step
        LLMEngine("tiny", EngineConfig(device="cpu"))


@pytest.mark.parametrize("floor", [0.0, 5.0])  # 5 s: more than any step takes, never waited
def test_each_step_that_runs_sleeps_out_the_floor(monkeypatch, floor):
    """Every step that computes something sleeps what is left of the floor after its own time (so a
    job of N tokens takes at least N floors); a step with nothing to run does not sleep; without the
    variable nothing sleeps. time.sleep is recorded, not waited: the test does not depend on timing."""
    if floor:
        monkeypatch.setenv(STEP_FLOOR_ENV, str(floor))
    else:
        monkeypatch.delenv(STEP_FLOOR_ENV, raising=False)
    eng = LLMEngine("tiny", EngineConfig(device="cpu", async_scheduling=False))
    slept: list[float] = []
    monkeypatch.setattr(engine_mod.time, "sleep", slept.append)
    eng.add_request("r", prompt_token_ids=[5, 6, 7, 8], sampling=SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    assert steps == 3  # one prefill step (the first token), two decode steps
    eng.step()  # nothing left to run
    if floor:
        assert len(slept) == steps and all(0.0 < s <= floor for s in slept), slept
    else:
        assert slept == []
