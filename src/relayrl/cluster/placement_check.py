"""Placement that refuses what cannot work, before anything starts (``cluster: ray``).

``check_placement`` raises one ``ConfigError`` line naming the keys for:

- fractional ``gpus_per_bundle`` on a pool whose ranks form a trainer process group (a
  data-parallel actor / critic, any FSDP2 role): Ray may put two ranks on one GPU and NCCL
  refuses two ranks on the same device;
- ``weight_sync.backend: nccl`` to a rollout pool of its own without GPUs (or from a trainer
  pool without GPUs): NCCL needs a GPU at both ends (``auto`` picks gloo there,
  ``weight_backend``);
- more ranks in a trainer pool than sequences in a step (``algo.prompts_per_step *
  algo.group_size``): every step would leave the extra ranks without a row (they would only
  join the collectives with zero gradients, on resources reserved for nothing), a
  configuration mistake rather than what a mid-run drop of groups leaves, which trains;
- more ``ray.rollout_replicas`` than the rollout pool's bundles;
- a pool whose ranks form a trainer process group without GPUs (``gpus_per_bundle: 0``) on a
  cluster that has GPUs while ``model.device`` is not ``cpu``: Ray reserves no GPU for those
  ranks, each takes ``cuda:<rank % visible GPUs>`` of its node, and where a node holds more
  of them than it has GPUs two ranks share one, which NCCL refuses;
- pools that do not fit the cluster: the CPUs / GPUs of all pools together more than the
  cluster has, or one bundle (a ``STRICT_PACK`` pool: all its bundles) more than any node.

No Ray import here: the checks are pure functions of the config and of the resources that
the caller read from Ray (``ray.cluster_resources()``, ``ray.nodes()``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from relayrl.config import ConfigError, RunConfig

TRAINER_ROLES = frozenset({"actor", "critic", "reference"})


def rollout_pool(cfg: RunConfig) -> str:
    return cfg.ray.placement.get("rollout", next(iter(cfg.ray.pools)))


def actor_pool(cfg: RunConfig) -> str:
    return cfg.ray.placement.get("actor", next(iter(cfg.ray.pools)))


def weight_backend(cfg: RunConfig, trainer_on_cuda: bool) -> str:
    """The weight group's backend: ``weight_sync.backend``, or for ``auto`` NCCL only when
    trainer rank 0 computes on CUDA AND the rollout pool has GPUs, else gloo."""
    chosen = cfg.weight_sync.backend
    if chosen != "auto":
        return str(chosen)
    rollout_gpus = cfg.ray.pools[rollout_pool(cfg)].gpus_per_bundle > 0
    return "nccl" if trainer_on_cuda and rollout_gpus else "gloo"


def _ranks_grouped(cfg: RunConfig, roles: Sequence[str], bundles: int) -> bool:
    if bundles < 2:
        return False  # one rank: no peer to share a device with
    if cfg.model.fsdp.enabled:
        return bool(TRAINER_ROLES & set(roles))
    return bool({"actor", "critic"} & set(roles))


def static_problems(cfg: RunConfig, by_pool: Mapping[str, Sequence[str]]) -> list[str]:
    """What the config alone shows cannot run (see the module docstring)."""
    out = []
    for name, roles in by_pool.items():
        pool = cfg.ray.pools[name]
        g = pool.gpus_per_bundle
        if g > 0 and g != int(g) and _ranks_grouped(cfg, roles, pool.bundles):
            out.append(
                f"ray.pools.{name}.gpus_per_bundle={g:g}: the {pool.bundles} trainer ranks of "
                f"pool {name!r} ({', '.join(sorted(TRAINER_ROLES & set(roles)))}) form an NCCL "
                "group, and fractional GPUs can put two ranks on one GPU, which NCCL refuses: "
                "use a whole number of GPUs per bundle"
            )
    rows = cfg.algo.prompts_per_step * cfg.algo.group_size
    for name, roles in by_pool.items():
        bundles = cfg.ray.pools[name].bundles
        trainer = sorted(TRAINER_ROLES & set(roles))
        if trainer and bundles > rows:
            out.append(
                f"ray.pools.{name}.bundles={bundles}: pool {name!r} ({', '.join(trainer)}) "
                f"splits each step's {rows} sequences (algo.prompts_per_step * "
                f"algo.group_size = {cfg.algo.prompts_per_step} x {cfg.algo.group_size}) over "
                f"{bundles} ranks, so {bundles - rows} would never get a row: use at most "
                f"{rows} bundles or more sequences per step"
            )
    ro = rollout_pool(cfg)
    if "rollout" in by_pool.get(ro, ()) and cfg.ray.rollout_replicas > cfg.ray.pools[ro].bundles:
        out.append(
            f"ray.rollout_replicas={cfg.ray.rollout_replicas}: pool {ro!r} "
            f"(ray.placement.rollout) has {cfg.ray.pools[ro].bundles} bundles, one per replica"
        )
    ws = cfg.weight_sync
    separate = ro != actor_pool(cfg)
    if separate and ws.transport == "collective" and ws.backend == "nccl":
        for key, name in (("rollout", ro), ("actor", actor_pool(cfg))):
            if cfg.ray.pools[name].gpus_per_bundle == 0:
                out.append(
                    f"weight_sync.backend=nccl: the {key} pool {name!r} has no GPUs "
                    f"(ray.pools.{name}.gpus_per_bundle=0) and NCCL needs one at both ends: "
                    "use weight_sync.backend=auto (gloo there) or give the pool GPUs"
                )
    return out


def _demand(cfg: RunConfig, name: str) -> dict[str, float]:
    pool = cfg.ray.pools[name]
    return {"CPU": pool.cpus_per_bundle, "GPU": pool.gpus_per_bundle}


def fit_problems(
    cfg: RunConfig,
    by_pool: Mapping[str, Sequence[str]],
    cluster: Mapping[str, float],
    nodes: Sequence[Mapping[str, float]],
) -> list[str]:
    """Pools that do not fit ``cluster`` (total resources) or any single node, and trainer
    groups that would compute on GPUs Ray did not reserve for them."""
    out = []
    names = list(by_pool)
    gpus = float(cluster.get("GPU", 0.0))
    for n in names:
        pool = cfg.ray.pools[n]
        grouped = _ranks_grouped(cfg, by_pool[n], pool.bundles)
        if gpus > 0 and pool.gpus_per_bundle == 0 and cfg.model.device != "cpu" and grouped:
            out.append(
                f"ray.pools.{n}.gpus_per_bundle=0: the cluster has {gpus:g} GPUs and "
                f"model.device={cfg.model.device} computes on them, but Ray reserves none for "
                f"the {pool.bundles} ranks of pool {n!r}: each would take cuda:<rank % GPUs> "
                "of its node and two can share one, which NCCL refuses: set gpus_per_bundle: 1 "
                "(or model.device=cpu)"
            )
    for res, key in (("CPU", "cpus_per_bundle"), ("GPU", "gpus_per_bundle")):
        need = sum(_demand(cfg, n)[res] * cfg.ray.pools[n].bundles for n in names)
        have = float(cluster.get(res, 0.0))
        if need > have + 1e-9:
            parts = " + ".join(
                f"ray.pools.{n}.bundles x {key} = {cfg.ray.pools[n].bundles} x "
                f"{_demand(cfg, n)[res]:g}"
                for n in names
            )
            out.append(f"the pools need {need:g} {res}s ({parts}), the cluster has {have:g}")
    for n in names:
        pool = cfg.ray.pools[n]
        scale = pool.bundles if pool.strategy == "STRICT_PACK" else 1
        bundle = {r: v * scale for r, v in _demand(cfg, n).items() if v > 0}
        if nodes and not any(
            all(float(node.get(r, 0.0)) + 1e-9 >= v for r, v in bundle.items()) for node in nodes
        ):
            what = "its bundles together (STRICT_PACK)" if scale > 1 else "one bundle"
            out.append(
                f"ray.pools.{n}: {what} needs {bundle} and no node has that much "
                f"(largest: {max(nodes, key=lambda x: x.get('GPU', 0) + x.get('CPU', 0))})"
            )
    return out


def check_placement(
    cfg: RunConfig,
    by_pool: Mapping[str, Sequence[str]],
    cluster: Mapping[str, float] | None = None,
    nodes: Sequence[Mapping[str, float]] = (),
) -> None:
    """Raise ``ConfigError`` (one line) for the first placement that cannot work; with
    ``cluster`` (and ``nodes``) also for pools that do not fit them."""
    problems = static_problems(cfg, by_pool)
    if cluster is not None:
        problems += fit_problems(cfg, by_pool, cluster, nodes)
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ConfigError(problems[0] + more)
