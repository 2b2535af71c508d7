"""A Tinker-compatible training service (``relayrl tinker-serve``): scripts written for the
Tinker SDK (``tinker.ServiceClient``) train and sample local models through relayrl.

Modules: :mod:`~relayrl.tinker.losses` (the SDK's built-in losses), :mod:`~relayrl.tinker.wire`
(the protobuf bodies), :mod:`~relayrl.tinker.checkpoints` (atomic ``tinker://`` checkpoints),
:mod:`~relayrl.tinker.service` (models, optimizers, samplers, one worker thread),
:mod:`~relayrl.tinker.server` (the HTTP routes). See docs/tinker.md.
"""
