"""Labs (the top floor, beside ``demo``): experiments built from the layers below.

- ``lab``        -- ``relayrl demo rlhf``: the city-language reward-hacking lab's pipeline,
  SFT -> pairs -> RM -> PPO(beta) -> DPO -> report
- ``word_model`` -- its word-level tokenizer and tiny Llama
- ``measures``   -- its measurements (pairs, RM agreement, blind spot, policy evaluation)
- ``report``     -- its ``report.md`` and PNG plots
- ``cli``        -- the ``relayrl rm`` / ``relayrl dpo`` subcommands and the ``demo rlhf`` entry

The parts the lab is made of live in their layers: the city language and preference pairs in
``relayrl.data`` (``city_lang``, ``preferences``), the Bradley-Terry and DPO losses in
``relayrl.algos.preference_loss``, the reward model's head in ``relayrl.model.reward_model``,
scoring with it in ``relayrl.reward.service.rm_scorer``, reward-model training and DPO in
``relayrl.controller`` (``rm_training``, ``dpo``), the run monitors in
``relayrl.telemetry.monitors``. Nothing below imports this package.
"""
