"""What TRL's PPOTrainer constructor is given, checked and prepared (`lmppo.trl.inputs`): TRL's derived sizes by
hand, the prompts' ids from either dataset shape, and the arguments refused in one line."""

from __future__ import annotations

import pytest

from lmppo.errors import ConfigError, LmppoError
from lmppo.trl.inputs import TrlCounts, check_arguments, prompt_ids, set_trl_sizes
from trl_support import args


def test_set_trl_sizes_derives_trls_sizes_into_the_config():
    """2 per device x 3 accumulation = 6 per process; 2 processes: 12 an update; 3 minibatches of 4 (2 a process);
    10 prompts x 2 epochs = 20 episodes: ceil(20 / 12) = 2 updates."""
    a = args(per_device_train_batch_size=2, gradient_accumulation_steps=3, num_mini_batches=3, num_train_epochs=2)
    assert set_trl_sizes(a, world=2, num_prompts=10) == TrlCounts(total_episodes=20, updates=2)
    assert (a.world_size, a.local_batch_size, a.micro_batch_size, a.batch_size) == (2, 6, 4, 12)
    assert (a.mini_batch_size, a.local_mini_batch_size, a.total_episodes, a.num_total_batches) == (4, 2, 20, 2)
    given = args(per_device_train_batch_size=2, gradient_accumulation_steps=3, total_episodes=30)
    assert set_trl_sizes(given, world=1, num_prompts=10) == TrlCounts(total_episodes=30, updates=5)  # ceil(30 / 6)
    given.num_mini_batches = 4  # set after the config checked itself: 4 does not divide 6
    with pytest.raises(ConfigError, match=r"`num_mini_batches` = 4: must divide local_batch_size \(6 = "):
        set_trl_sizes(given, world=1, num_prompts=10)


def test_prompt_ids_of_rows_and_of_id_lists():
    assert prompt_ids([{"input_ids": [5, 6, 7]}, {"input_ids": [8]}]) == [[5, 6, 7], [8]]
    assert prompt_ids([[5, 6], [7]]) == [[5, 6], [7]]


def test_constructor_arguments_lmppo_cannot_take_are_refused():
    model = object()
    good = dict(model=model, ref_model=None, reward_model=object(), value_model=object(), train_dataset=[[1]])
    check_arguments(args(), data_collator=None, optimizers=(None, None), **good)  # accepted
    with pytest.raises(LmppoError, match="args must be an lmppo.trl.PPOConfig, got a dict"):
        check_arguments({}, data_collator=None, optimizers=None, **good)
    with pytest.raises(ConfigError, match="`data_collator` = 'list': lmppo left-pads"):
        check_arguments(args(), data_collator=[], optimizers=None, **good)
    with pytest.raises(ConfigError, match="`ref_model` = 'the policy model': must not be `model` itself"):
        check_arguments(args(), data_collator=None, optimizers=None, **{**good, "ref_model": model})
    with pytest.raises(ConfigError, match="`value_model` = None: is required"):
        check_arguments(args(), data_collator=None, optimizers=None, **{**good, "value_model": None})
