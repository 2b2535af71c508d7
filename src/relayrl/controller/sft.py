"""Supervised fine-tuning on prompt/response pairs (the warm start before RL).

Prompts are rendered and tokenised exactly as the RL path does (``render_prompt``: the
tokenizer's chat template when it has one and ``data.source.chat_template`` is on, the raw text
otherwise), and the format used is written beside the weights (``prompt_format.json``), so
``relayrl train | eval`` warn when they would ask the model in another one.

Loss: token-mean negative log-likelihood of the response tokens (response + EOS), prompt
tokens masked: L = -sum_t m_t log pi(y_t | x, y_<t) / sum_t m_t, where m_t = 1 on real response
tokens, times 0 on the tokens of a record's untrained segments (an environment's observations
in a multi-turn trace, ``SFTRecord.segments``), so, as with an RL trajectory's loss mask, only
model-written tokens are learned; they are still inputs to the tokens after them.
"""

from __future__ import annotations

import json
import random
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from relayrl.config import SFTConfig
from relayrl.controller.checkpoint import (
    checkpoint_step,
    latest_checkpoint,
    load_trainer_state,
    newest_intact,
    rng_state,
    save_checkpoint,
    set_rng_state,
    write_failure,
)
from relayrl.controller.evaluate import greedy_pass_rate
from relayrl.controller.faults import RunFault, RunInterrupted, StepGuard, signal_name
from relayrl.controller.preflight import check_sft_lengths, check_sft_val_prompts
from relayrl.controller.run_dir import output_dir_locked
from relayrl.data import PromptRecord, SFTRecord, load_sft_jsonl
from relayrl.data.prompt_format import FORMAT_FILE, prompt_format
from relayrl.data.prompts import arithmetic_task, load_prompts, render_prompt, tokenize_prompts
from relayrl.model import (
    forward_logprobs,
    load_causal_lm,
    load_tokenizer,
    pack_batch,
    save_model_atomic,
    set_threads,
)
from relayrl.reward import get_reward_fn
from relayrl.rollout import RolloutEngine
from relayrl.telemetry import StepProgress
from relayrl.workers.optim import make_optimizer
from relayrl.workers.reward import RewardWorker

KEEP = ("checkpoints",)
"""What the final save carries from the old ``output_dir`` into the new one."""


def sft_records(cfg: SFTConfig) -> list[SFTRecord]:
    if cfg.task == "jsonl":
        if cfg.train_path is None:
            raise ValueError("train_path is required when task is 'jsonl'")
        return load_sft_jsonl(cfg.train_path)
    task = arithmetic_task(cfg.arithmetic, seed=cfg.seed + 1)
    return task.sft_records(cfg.num_examples)


def tokenize_record(
    tokenizer: Any,
    rec: SFTRecord,
    use_chat_template: bool = True,
    system_prompt: str | None = None,
) -> tuple[list[int], list[int], list[int]]:
    """Prompt ids as the RL path tokenises them (``render_prompt``, then special tokens added
    only to a prompt no template rendered, as ``encode_prompts`` does), response ids ending
    with EOS, and the loss mask over the response ids (1: trained, 0: an untrained segment; EOS
    is trained). A record with ``segments`` is tokenised segment by segment (as the runner
    renders turn by turn, never across a turn's boundary); without, the response is one piece,
    all trained."""
    text, templated = render_prompt(
        PromptRecord(rec.prompt), tokenizer, use_chat_template, system_prompt
    )
    prompt = list(tokenizer(text, add_special_tokens=not templated).input_ids)
    pieces = rec.segments if rec.segments is not None else ((rec.response, True),)
    response: list[int] = []
    mask: list[int] = []
    for text, trained in pieces:
        ids = list(tokenizer(text, add_special_tokens=False).input_ids) if text else []
        response += ids
        mask += [int(trained)] * len(ids)
    return prompt, response + [tokenizer.eos_token_id], mask + [1]


def tokenize_pair(
    tokenizer: Any, rec: SFTRecord, use_chat_template: bool = True
) -> tuple[list[int], list[int]]:
    """Prompt ids as the RL path tokenises them; response ids end with EOS."""
    prompt, response, _ = tokenize_record(tokenizer, rec, use_chat_template)
    return prompt, response


def masked_nll(
    logp: torch.Tensor, response_mask: torch.Tensor, loss_masks: list[list[int]]
) -> torch.Tensor:
    """L = -sum_t m_t logp_t / sum_t m_t with m = ``response_mask`` (``[B, R]``, 1 on real
    tokens) times each row's ``loss_masks`` entry (right-padded with 0 to ``R``)."""
    m = torch.zeros_like(response_mask)
    for i, row in enumerate(loss_masks):
        m[i, : len(row)] = torch.as_tensor(row, dtype=m.dtype)
    m = m * response_mask
    return -(logp * m).sum() / m.sum()


def run_sft(
    cfg: SFTConfig,
    exclude_prompts: set[str] | None = None,
    validate: Callable[[torch.nn.Module], float] | None = None,
    resume_from: Path | None = None,
    save_on_signal: bool = False,
    output_locked: bool = False,
) -> dict[str, float]:
    """Fine-tune ``model_path`` and save it (HF format, atomically) to ``output_dir``.

    With ``save_every``, a checkpoint (weights, optimizer, scheduler, the example sampler and
    RNG states) is written every N steps into ``output_dir/checkpoints``, and after the last
    step (``steps``, or the step that reached ``target_pass_rate``); ``resume_from`` (one of
    them) continues the run where it stopped, on the same examples (``--resume`` with a larger
    ``steps`` goes on from the final step). A write that fails is a
    ``RunFault`` naming the newest intact checkpoint. With ``save_on_signal`` (``relayrl sft``)
    SIGINT / SIGTERM checkpoint the last completed step first, as ``relayrl train`` does (a
    signal during a weight update waits for the end of that step; see ``StepGuard``).

    Every ``eval_every`` steps the validation pass rate is measured (``sft/val_pass_rate``) and
    the run stops once it reaches ``target_pass_rate``: by the built-in greedy single-turn
    validator, or by ``validate(model)`` when given (e.g. multi-turn episodes with a tool; it
    sees the live module, in eval mode, under no_grad). One optimizer runs throughout.

    Before the first step (one-line errors): the tokenizer files and vocabulary
    (``load_tokenizer``), and every example and validation prompt against the model's context
    (``relayrl.controller.preflight``). Progress goes to the console as a bar on a terminal,
    as plain lines every ``$RELAYRL_PROGRESS_INTERVAL_S`` seconds otherwise.

    ``output_dir`` is locked for the run (``relayrl.controller.run_dir.output_dir_locked``,
    ``.<name>.lock`` beside it; ``RunDirError`` naming the holder when another process holds
    it), and what a run killed in its final save left beside it is completed first (its new
    model put in place, its ``checkpoints/`` carried back), unless ``output_locked``: the caller
    holds that lock already and has done that (``relayrl sft``, by ``claim_output_dir``; a
    second lock in one process would refuse the first)."""
    if not output_locked:
        with output_dir_locked(cfg.output_dir, keep=KEEP) as recovered:
            for line in recovered:  # a run killed in its final save: completed first
                print(line)
            return run_sft(
                cfg, exclude_prompts, validate, resume_from, save_on_signal, output_locked=True
            )
    set_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model_path)
    model = load_causal_lm(resume_from / "model" if resume_from else cfg.model_path)
    records = [
        r for r in sft_records(cfg) if not exclude_prompts or r.prompt not in exclude_prompts
    ]
    fmt = cfg.data.source
    triples = [tokenize_record(tokenizer, r, fmt.chat_template, fmt.system_prompt) for r in records]
    pairs = [(p, r) for p, r, _ in triples]
    if not pairs:
        raise ValueError("no SFT examples")
    source = cfg.train_path if cfg.task == "jsonl" else "the arithmetic task"
    check_sft_lengths(cfg.model_path, [len(p) + len(r) for p, r in pairs], str(source))
    decay = cfg.steps if cfg.lr_schedule == "linear" else None
    opt, sched = make_optimizer(
        list(model.parameters()), cfg.lr, cfg.weight_decay, (0.9, 0.99), cfg.warmup_steps, decay
    )
    rng = random.Random(cfg.seed)
    check: Callable[[], float] | None
    if validate is not None:
        if not cfg.eval_every:
            raise ValueError("run_sft: a validate callback needs eval_every >= 1")
        check = _live(validate, model)
    else:
        check = _validator(cfg, model, tokenizer, exclude_prompts) if cfg.eval_every else None
    start = 0
    if resume_from is not None:
        state = load_trainer_state(resume_from)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        rng.setstate(state["sampler"])
        set_rng_state(state["rng"])
        start = int(state["step"])
        print(f"resumed from {resume_from} at step {start}")
    model.train()
    loss_val = float("nan")
    out: dict[str, float] = {}
    guard = StepGuard().install() if save_on_signal else None
    done, boundary = start, (rng.getstate(), rng_state())  # the last completed step's state
    try:
        with StepProgress(cfg.steps, "sft", enabled=cfg.progress, initial=start) as bar:
            for step in range(start, cfg.steps):
                chosen = [triples[rng.randrange(len(triples))] for _ in range(cfg.batch_size)]
                batch = pack_batch(
                    [p for p, _, _ in chosen], [r for _, r, _ in chosen], tokenizer.pad_token_id
                )
                logp, _ = forward_logprobs(model, batch)
                loss = masked_nll(logp, batch.response_mask, [m for _, _, m in chosen])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if cfg.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
                if guard is not None:
                    guard.committing = True  # a signal now waits for the end of the step
                opt.step()
                sched.step()
                loss_val = float(loss.detach())
                out = {"sft/loss": loss_val, "sft/steps": float(step + 1)}
                stop = False
                if check is not None and (step + 1) % cfg.eval_every == 0:
                    out["sft/val_pass_rate"] = check()
                    model.train()
                    bar.update(step + 1, loss=loss_val, val_pass=out["sft/val_pass_rate"])
                    target = cfg.target_pass_rate
                    stop = target is not None and out["sft/val_pass_rate"] >= target
                else:
                    bar.update(step + 1, loss=loss_val)
                last = stop or step + 1 == cfg.steps  # resumable with more steps
                if cfg.save_every and ((step + 1) % cfg.save_every == 0 or last):
                    state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
                    state["sampler"] = rng.getstate()
                    keep = cfg.keep_checkpoints
                    save_checkpoint(
                        cfg.output_dir, step + 1, {"model": model}, tokenizer, state, keep
                    )
                done, boundary = step + 1, (rng.getstate(), rng_state())
                if guard is not None:
                    guard.end_step()  # a signal held during the update stops the run here
                if stop:
                    break
    except KeyboardInterrupt as exc:
        if guard is None:
            raise
        at = (opt, sched, boundary, done, start)
        raise _stopped(exc, cfg, model, tokenizer, guard, at) from exc
    finally:
        if guard is not None:
            guard.restore()
    fmt_used = prompt_format(tokenizer, fmt.chat_template, fmt.system_prompt)
    used = {FORMAT_FILE: json.dumps(fmt_used) + "\n"}
    try:
        save_model_atomic(model, tokenizer, cfg.output_dir, used, keep=KEEP)
    except Exception as exc:  # an OSError, or torch's / safetensors' wording of one
        reason = write_failure(exc, Path(cfg.output_dir))
        if reason is None:
            raise
        intact = newest_intact(cfg.output_dir)
        tail = "; write it with --resume" if intact.startswith("the newest") else ""
        raise RunFault(
            f"the model could not be written to {cfg.output_dir} ({reason}); {intact}{tail}"
        ) from exc
    return {**out, "sft/examples": float(len(pairs))}


def _stopped(
    exc: KeyboardInterrupt,
    cfg: SFTConfig,
    model: Any,
    tokenizer: Any,
    guard: StepGuard,
    saved: tuple[Any, Any, tuple[Any, dict[str, Any]], int, int],
) -> RunInterrupted:
    """Checkpoint the last completed step (weights, optimizer and scheduler are still that
    step's unless a second signal abandoned an update); the one line that says so."""
    opt, sched, (sampler, rng), done, start = saved
    signum = getattr(exc, "signum", signal.SIGINT)
    name = signal_name(signum)
    newest = latest_checkpoint(cfg.output_dir)
    if not guard.clean:
        what = f"stopped by {name} during step {done + 1} (a second signal abandoned it)"
    elif done == start or (newest is not None and checkpoint_step(newest) == done):
        what = f"stopped by {name} after step {done}"
    else:
        what = f"stopped by {name} after step {done}"
        state = {"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}
        state["sampler"] = sampler
        try:
            path = save_checkpoint(
                cfg.output_dir, done, {"model": model}, tokenizer, state, cfg.keep_checkpoints, rng
            )
        except RunFault as fault:
            return RunInterrupted(signum, f"{what}; {fault}")
        return RunInterrupted(signum, f"{what}; checkpoint {path} written; continue with --resume")
    intact = newest_intact(cfg.output_dir)
    tail = "; continue with --resume" if intact.startswith("the newest") else ""
    return RunInterrupted(signum, f"{what}; {intact}{tail}")


def _live(validate: Callable[[torch.nn.Module], float], model: Any) -> Callable[[], float]:
    def check() -> float:
        model.eval()
        with torch.no_grad():
            return float(validate(model))

    return check


def _validator(
    cfg: SFTConfig, model: Any, tokenizer: Any, exclude_prompts: set[str] | None
) -> Callable[[], float]:
    """Greedy pass rate on ``val_path`` or on a validation stream of the arithmetic task
    (never the RL eval set: ``exclude_prompts``)."""
    rows: Sequence[PromptRecord]
    if cfg.val_path is not None:
        rows = load_prompts(cfg.val_path)
    elif cfg.task == "arithmetic":
        task = arithmetic_task(cfg.arithmetic, seed=cfg.seed + 2)
        rows = task.sample(2 * cfg.eval_size)
    else:
        raise ValueError("SFT eval_every needs task 'arithmetic' or a val_path (prompt, answer)")
    records = [r for r in rows if r.prompt not in (exclude_prompts or ())]
    fmt = cfg.data.source  # the prompt format, as trained
    prompts = tokenize_prompts(
        records[: cfg.eval_size], tokenizer, 10**9, fmt.chat_template, fmt.system_prompt
    )[0]
    engine = RolloutEngine(
        model,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_slots=cfg.eval_size,
    )  # shares the module: it always sees the current weights
    reward = RewardWorker(get_reward_fn(cfg.val_reward), tokenizer)
    max_tokens = max(len(tokenizer(r.response).input_ids) for r in sft_records(cfg)[:200]) + 2
    check_sft_val_prompts(
        cfg.model_path,
        [len(p.ids) for p in prompts],
        max_tokens,
        cfg.val_path or "the arithmetic validation stream",
    )

    def validate() -> float:
        with torch.no_grad():
            res = greedy_pass_rate(engine, reward, prompts, max_tokens, [tokenizer.eos_token_id])
        return res["eval/pass_rate"]

    return validate
