"""train.epochs: a pass count instead of a step count, validated with a clear error."""

from __future__ import annotations

import pytest
from dflash.pipeline.train_config import TrainConfigError, config_from_dict, steps_for_epochs


def test_epochs_become_enough_steps_to_see_every_sample_that_often():
    assert steps_for_epochs(1.0, 4000, 16) == 250
    assert steps_for_epochs(2.5, 100, 16) == 16  # rounded up: the last pass is complete
    assert steps_for_epochs(0.001, 10, 16) == 1


def test_epochs_must_be_positive_and_need_samples():
    assert config_from_dict({"train": {"epochs": 2}}).train.epochs == 2
    assert config_from_dict({}).train.epochs is None
    for bad in (0, -1):
        with pytest.raises(TrainConfigError, match="train.epochs"):
            config_from_dict({"train": {"epochs": bad}})
    with pytest.raises(TrainConfigError, match="train.epochs"):
        steps_for_epochs(1.0, 0, 16)
