"""The asynchronous reward service: samples scored as they finish, off the generation path.

- ``server``: ``RewardService`` (submit / poll / score_batch), ``build_reward_service``;
- ``worker_pool``: the process pool that runs reward functions, with restarts and timeouts;
- ``guards``: a reward function's call and its return contract, checked in the worker;
- ``model_lanes`` / ``rm_scorer``: batched model scorers (a reward model) beside the functions.
"""

from relayrl.reward.service.server import *  # noqa: F403  (its public names, ``__all__``)
from relayrl.reward.service.server import __all__ as __all__
