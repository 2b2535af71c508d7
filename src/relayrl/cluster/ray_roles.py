"""The ``ray`` cluster: build the roles of a run as worker groups on resource pools.

``build_ray_roles(cfg, actor_path, critic_path)`` returns the same :class:`Roles` as the local
backend, so ``trainer.train(cfg, lambda a, c: build_ray_roles(cfg, a, c))`` runs every
schedule unchanged. Placement comes from ``cfg.ray``: roles on one pool are colocated in the
pool's processes (a rollout engine there copies the actor's weights in-process); a rollout
pool of its own runs ``ray.rollout_replicas`` engines that get weights through the object
store (or, with ``weight_sync.transport: collective``, over a process group of trainer rank 0
and the replicas). The actor is data-parallel over the bundles of its pool (a gloo process
group; NCCL for CUDA tensors); with ``model.fsdp.enabled`` actor, critic and reference are
FSDP2-sharded over it. A trainer pool's hosts join the group before they build their roles.
The reward role runs in the controller process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import torch

from relayrl.cluster.placement_check import check_placement
from relayrl.cluster.ray_pools import (
    ResourcePool,
    alive_nodes,
    create_pools,
    ensure_ray,
    role_pools,
)
from relayrl.cluster.ray_rollout import RayRolloutClient
from relayrl.cluster.ray_weight_sync import WeightGroupMembers
from relayrl.cluster.ray_workers import HostSpec, RemoteRole, RoleHostActor, WorkerGroup
from relayrl.config import RunConfig
from relayrl.model import load_causal_lm, load_critic, load_tokenizer, resolve_threads
from relayrl.model.device import precision_for
from relayrl.model.lora import apply_lora
from relayrl.reward import build_reward_service
from relayrl.reward.service.rm_scorer import build_reward_fn
from relayrl.rollout import GenerationRequest
from relayrl.workers import RewardWorker, Roles

TRAINER_ROLES = frozenset({"actor", "critic", "reference"})


def grouped(cfg: RunConfig, roles: list[str], size: int) -> bool:
    """Whether a pool's hosts join a process group before building: a data-parallel actor
    or critic (``size`` > 1), or any FSDP2 role (also on one rank)."""
    if cfg.model.fsdp.enabled:
        return bool(TRAINER_ROLES & set(roles))
    return size > 1 and bool({"actor", "critic"} & set(roles))


def needed_roles(cfg: RunConfig) -> list[str]:
    roles = ["actor", "rollout"]
    if cfg.algo.kl_coef > 0 or cfg.algo.name == "ppo":
        roles.append("reference")
    if cfg.algo.name == "ppo":
        roles.append("critic")
    return roles


def _admission_version(cfg: RunConfig) -> Callable[[GenerationRequest], int] | None:
    """Overlap / async: group g was admitted at trainer version g // B - eta (the gate
    ``floor(g / B) <= i + eta``); its tokens must come from weights at least that new."""
    eta = cfg.staleness_eta
    if cfg.schedule == "sync" or eta is None:
        return None
    b = cfg.algo.prompts_per_step

    def min_version(req: GenerationRequest) -> int:
        return -1 if req.group_id is None else int(req.group_id) // b - eta

    return min_version


def group_of_actor(groups: dict[str, WorkerGroup], by_pool: dict[str, list[str]]) -> WorkerGroup:
    return groups[next(n for n, rs in by_pool.items() if "actor" in rs)]


def _start_host(pool: ResourcePool, rank: int, spec: HostSpec, weights: Any = None) -> Any:
    return RoleHostActor.options(name=None, max_restarts=0, **pool.options(rank)).remote(
        spec, weights
    )


def build_ray_roles(cfg: RunConfig, actor_path: str, critic_path: str | None) -> Roles:
    """Place the roles of ``cfg`` on Ray resource pools and return their controller-side
    handles (``roles.close()`` stops the processes and frees the pools)."""
    by_pool = role_pools(cfg.ray, needed_roles(cfg))
    check_placement(cfg, by_pool)  # what cannot work, before Ray starts
    ensure_ray(cfg.ray)
    check_placement(cfg, by_pool, ray.cluster_resources(), alive_nodes())  # ... fits?
    torch.set_num_threads(1)  # the driver only tokenises and moves batches
    dtype = precision_for(cfg.model, trainable=True).param_dtype  # the shadows' (HF export)
    tokenizer = load_tokenizer(cfg.model.path)
    pools = create_pools(cfg.ray, list(by_pool))
    groups: dict[str, WorkerGroup] = {}
    hosts: list[Any] = []

    def stop_all() -> None:
        for h in hosts:
            ray.kill(h, no_restart=True)
        for p in pools.values():
            p.remove()

    replicas = cfg.ray.rollout_replicas
    # ``threads: auto`` splits the idle CPUs among this machine's trainer-side host processes
    # (rollout-only hosts take ``rollout.threads`` each)
    rollout_only = [n for n, rs in by_pool.items() if rs == ["rollout"]]
    trainer_hosts = sum(pools[n].size for n in by_pool if n not in rollout_only)
    reserved = sum(min(pools[n].size, replicas) for n in rollout_only) * cfg.rollout.threads
    host_threads = resolve_threads(cfg.threads, reserved=reserved, share=trainer_hosts)
    try:
        for name, roles in by_pool.items():
            pool = pools[name]
            if "rollout" in roles and replicas > pool.size:
                raise ValueError(
                    f"ray.rollout_replicas={replicas} needs {replicas} bundles in pool "
                    f"{name!r}, it has {pool.size}"
                )
            threads = host_threads if roles != ["rollout"] else cfg.rollout.threads
            group_hosts = []
            group_on = grouped(cfg, roles, pool.size)
            engines = group_on and cfg.model.fsdp.enabled and "rollout" in roles
            for rank in range(pool.size):
                here = tuple(r for r in roles if r != "rollout" or rank < replicas)
                if not here:
                    continue
                spec = HostSpec(
                    cfg, actor_path, critic_path, here, rank, pool.size, 0, threads, group_on
                )
                spec.engines_in_group = engines
                group_hosts.append(_start_host(pool, rank, spec))
            hosts.extend(group_hosts)
            groups[name] = WorkerGroup(group_hosts)
        ray.get([h.ready.remote() for h in hosts], timeout=300)
        for name, group in groups.items():  # trainer pools: the process group, then the roles
            if grouped(cfg, by_pool[name], group.size):
                addr, port = ray.get(group.hosts[0].open_rendezvous.remote(group.size))
                ray.get(
                    [
                        h.init_process_group.remote(addr, port, r, group.size)
                        for r, h in enumerate(group.hosts)
                    ]
                )
                ray.get([h.build.remote() for h in group.hosts], timeout=600)
    except BaseException:
        stop_all()
        raise

    rollout_pool = next(n for n, rs in by_pool.items() if "rollout" in rs)
    colocated = len(by_pool[rollout_pool]) > 1
    rollout_hosts = groups[rollout_pool].hosts[:replicas]
    pool = pools[rollout_pool]

    def restart_replica(index: int, weights_ref: Any, version: int) -> Any:
        spec = HostSpec(
            cfg,
            actor_path,
            critic_path,
            ("rollout",),
            index,
            pool.size,
            version,
            cfg.rollout.threads,
        )
        handle = _start_host(pool, index, spec, weights_ref)
        hosts.append(handle)
        return handle

    try:  # the client serves top_logprobs when every replica's engine keeps them
        top_logprobs = all(ray.get([h.rollout_top_logprobs.remote() for h in rollout_hosts]))
    except BaseException:
        stop_all()
        raise
    members: WeightGroupMembers | None = None
    if cfg.weight_sync.transport == "collective" and not colocated:
        # trainer rank 0 (rank 0, the rendezvous on its node) and each replica (ranks 1..R)
        # in a process group of their own, formed again when a replica is restarted
        members = WeightGroupMembers(
            group_of_actor(groups, by_pool).hosts,
            cfg.model.fsdp.enabled,
            cfg.weight_sync.timeout_s,
        )
        try:
            members.form(rollout_hosts)
        except BaseException:
            stop_all()
            raise
    rollout = RayRolloutClient(
        rollout_hosts,
        [colocated] * len(rollout_hosts),
        None if colocated else restart_replica,
        max_restarts=cfg.ray.max_replica_restarts,
        version=0,
        on_close=stop_all,
        min_version=_admission_version(cfg),
        members=members,
        sync_timeout_s=cfg.weight_sync.timeout_s,
        top_logprobs=top_logprobs,
    )

    def group_of(role: str) -> WorkerGroup:
        return groups[next(n for n, rs in by_pool.items() if role in rs)]

    sharded = cfg.model.fsdp.enabled
    lora = cfg.model.lora

    def actor_shadow() -> torch.nn.Module:
        if lora is None:
            return load_causal_lm(actor_path, dtype)
        # the base with fresh adapters; the actor's peft state (adapters) is loaded into it
        return apply_lora(load_causal_lm(cfg.model.path, dtype), lora)

    actor = RemoteRole(group_of("actor"), "actor", actor_shadow, sharded, lora is not None)
    reference = None
    if "reference" in needed_roles(cfg):
        reference = RemoteRole(
            group_of("reference"),
            "reference",
            lambda: load_causal_lm(cfg.model.path, dtype),
            sharded,
        )
    critic = None
    if "critic" in needed_roles(cfg):
        critic = RemoteRole(
            group_of("critic"),
            "critic",
            lambda: load_critic(critic_path or cfg.model.path, dtype),
            sharded,
        )
    reward = RewardWorker(
        build_reward_fn(cfg.reward),
        tokenizer,
        service=build_reward_service(cfg.reward, tokenizer),
        normalize=cfg.reward.service.normalize,
        domain_key=cfg.reward.service.domain_key,
        timeout_s=cfg.reward.fn_timeout_s,
    )
    return Roles(actor, rollout, reward, tokenizer, reference, critic)  # type: ignore[arg-type]
