"""Planning before spending GPU hours: time model, schedule simulator, resharding, placement,
execution-plan search and cost estimates (layer 9: imports nothing else from relayrl).

Quick tour::

    from relayrl.plan import (RooflineTimeModel, LognormalLengths, SimConfig, simulate,
                              get_model, get_hardware)
    tm = RooflineTimeModel(get_model("qwen2.5-1.5b"), get_hardware("h100"))
    lengths = LognormalLengths(median=2000, sigma=0.8, cap=16384)
    sync = simulate(SimConfig(tm, lengths, schedule="sync", n_devices=16))
    fast = simulate(SimConfig(tm, lengths, schedule="async", n_devices=16, train_devices=4, eta=2))
    fast.steady_samples_per_s / sync.steady_samples_per_s   # ~3.9

See ``docs/plan.md`` for the CLI (``relayrl simulate | reshard | placement | plan | cost |
profile``).
"""

from relayrl.plan.cost import (
    RLStepCost,
    generation_vs_training_flops,
    gpu_hours,
    model_set_memory_bytes,
    money,
    rl_step_cost,
    training_gpu_hours,
    two_pool_pipeline,
)
from relayrl.plan.envlatency import (
    ConstantLatency,
    EmpiricalLatency,
    FixedLatency,
    LognormalLatency,
    parse_latency,
)
from relayrl.plan.hardware import HARDWARE, HardwareSpec, get_hardware
from relayrl.plan.lengths import (
    ConstantLengths,
    EmpiricalLengths,
    FixedLengths,
    LognormalLengths,
    parse_lengths,
)
from relayrl.plan.models import MODELS, ModelSpec, get_model
from relayrl.plan.placement import (
    NAMED_PLACEMENTS,
    ROLES,
    RLHFWorkload,
    evaluate_placement,
    models_memory_bytes,
    placement_memory,
    search_placements,
    set_partitions,
)
from relayrl.plan.reshard import (
    STRATEGIES,
    ReshardPlan,
    compare_strategies,
    reshard,
    transfer_share,
    weight_transfer_time,
)
from relayrl.plan.search import (
    CALLS,
    Mesh,
    PlanEval,
    PPOProblem,
    Strategy,
    asymmetric_plan,
    greedy_plan,
    heuristic_plan,
    search_plan,
    symmetric_plan,
)
from relayrl.plan.simulator import SimConfig, SimResult, simulate, sparkline, speedup
from relayrl.plan.staleness import (
    admission_allowed,
    batch_index,
    batch_range,
    max_admitted_groups,
    min_version_to_admit,
    token_staleness,
)
from relayrl.plan.timemodel import (
    FixedStepTimeModel,
    MeasuredProfile,
    ProfiledTimeModel,
    RooflineTimeModel,
    steps_time,
)

__all__ = [
    "CALLS",
    "HARDWARE",
    "MODELS",
    "NAMED_PLACEMENTS",
    "ROLES",
    "STRATEGIES",
    "ConstantLatency",
    "ConstantLengths",
    "EmpiricalLatency",
    "EmpiricalLengths",
    "FixedLatency",
    "FixedLengths",
    "FixedStepTimeModel",
    "HardwareSpec",
    "LognormalLatency",
    "LognormalLengths",
    "MeasuredProfile",
    "Mesh",
    "ModelSpec",
    "PPOProblem",
    "PlanEval",
    "ProfiledTimeModel",
    "RLHFWorkload",
    "RLStepCost",
    "ReshardPlan",
    "RooflineTimeModel",
    "SimConfig",
    "SimResult",
    "Strategy",
    "admission_allowed",
    "asymmetric_plan",
    "batch_index",
    "batch_range",
    "compare_strategies",
    "evaluate_placement",
    "generation_vs_training_flops",
    "get_hardware",
    "get_model",
    "gpu_hours",
    "greedy_plan",
    "heuristic_plan",
    "max_admitted_groups",
    "min_version_to_admit",
    "model_set_memory_bytes",
    "models_memory_bytes",
    "money",
    "parse_latency",
    "parse_lengths",
    "placement_memory",
    "reshard",
    "rl_step_cost",
    "search_placements",
    "search_plan",
    "set_partitions",
    "simulate",
    "sparkline",
    "speedup",
    "steps_time",
    "symmetric_plan",
    "token_staleness",
    "training_gpu_hours",
    "transfer_share",
    "two_pool_pipeline",
    "weight_transfer_time",
]
