"""Fixtures of the bench tests."""
from __future__ import annotations

import pytest

from glm_ray.worker.model_runner import ModelRunner


@pytest.fixture
def runner_calls(monkeypatch) -> list:
    """(SchedulerOutput, ModelRunnerOutput) of every `ModelRunner.execute` call, in order."""
    seen: list = []
    orig = ModelRunner.execute

    def spy(self, step):
        out = orig(self, step)
        seen.append((step, out))
        return out
    monkeypatch.setattr(ModelRunner, "execute", spy)
    return seen
