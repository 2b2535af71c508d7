"""Run configuration: one YAML file validated into typed objects.

Every key maps one-to-one to a constructor argument or a loop setting. Unknown keys and wrongly
typed values are rejected with a one-line error naming the key (see ``ConfigError``). Any key
can be overridden from the command line as ``section.key=value``.

One module per YAML section (``model``, ``data``, ``reward``, ``algo``, ``optim``, ``rollout``,
``async`` -> ``asynchronous``, ``train``, ``logging``, ``eval``, ``monitor``, ``env``,
``weight_sync``, ``failures``, ``ray``), the whole run in ``run``, ``relayrl sft``'s config in
``sft``, the strict base and shared types in ``base``, YAML loading and overrides in ``io``.
The package is a leaf: it imports nothing from relayrl outside itself, so every layer may
read it; ``from relayrl.config import X`` names every class.
"""

from relayrl.config.agent import AgentConfig
from relayrl.config.algo import AlgoConfig, DistillConfig, EmptyRows, RolloutCorrectionConfig
from relayrl.config.asynchronous import AsyncConfig
from relayrl.config.base import (
    GROUP_ADVANTAGES,
    AdamBeta,
    BehavWeightMode,
    ConfigError,
    Fraction,
    KeyProblem,
    Seed,
    Threads,
    _Strict,
)
from relayrl.config.data import (
    ArithmeticConfig,
    DataConfig,
    DynamicSamplingConfig,
    PromptSourceConfig,
)
from relayrl.config.env import EnvConfig
from relayrl.config.eval import EvalConfig
from relayrl.config.failures import FailuresConfig
from relayrl.config.io import COMMAND_LINE, apply_overrides, dump_config, load_config
from relayrl.config.logging import LoggingConfig
from relayrl.config.model import FsdpConfig, LoraConfig, ModelConfig
from relayrl.config.monitor import MonitorConfig
from relayrl.config.optim import OptimConfig
from relayrl.config.ray import RayConfig, RayPoolConfig
from relayrl.config.reward import RewardConfig, RewardFnConfig, RewardServiceConfig
from relayrl.config.rollout import RolloutConfig
from relayrl.config.run import RunConfig
from relayrl.config.sft import SFTConfig, SFTDataConfig, SFTPromptFormat
from relayrl.config.train import TrainConfig
from relayrl.config.weight_sync import WeightSyncConfig

__all__ = [
    "COMMAND_LINE",
    "GROUP_ADVANTAGES",
    "AdamBeta",
    "AgentConfig",
    "AlgoConfig",
    "ArithmeticConfig",
    "AsyncConfig",
    "BehavWeightMode",
    "ConfigError",
    "DataConfig",
    "DistillConfig",
    "DynamicSamplingConfig",
    "EmptyRows",
    "EnvConfig",
    "EvalConfig",
    "FailuresConfig",
    "Fraction",
    "FsdpConfig",
    "KeyProblem",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "MonitorConfig",
    "OptimConfig",
    "PromptSourceConfig",
    "RayConfig",
    "RayPoolConfig",
    "RewardConfig",
    "RewardFnConfig",
    "RewardServiceConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "RunConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTPromptFormat",
    "Seed",
    "Threads",
    "TrainConfig",
    "WeightSyncConfig",
    "_Strict",
    "apply_overrides",
    "dump_config",
    "load_config",
]
