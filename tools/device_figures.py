"""The figures steps of the prepared GPU run (``tools/device_run.py``): actor update tokens/s,
MFU and peak memory against the planner's prediction; own-engine decode against the HBM
roofline and HF ``generate``, CUDA graphs on and off; where a decode step's time goes."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from device_common import (
    GB,
    RESULTS,
    Run,
    _r,
    _sync,
    _timed,
    qwen2_dir,
    qwen2_model,
    random_batch,
    run_config,
)


def _update_figures(
    run: Run, size: str, ac: bool, rows: int, prompt: int, response: int, micro: int, steps: int
) -> dict[str, Any]:
    from relayrl.model.device import apply_precision, enable_gradient_checkpointing, precision_for
    from relayrl.plan.memory import CALIBRATED, TrainShape
    from relayrl.workers.actor import ActorWorker

    path = qwen2_dir(run, size)
    cfg = run_config(
        path,
        run.device,
        "model.dtype=bfloat16",
        f"model.gradient_checkpointing={str(ac).lower()}",
        f"algo.micro_batch_size={micro}",
    )
    precision = precision_for(cfg.model, trainable=True)
    model = qwen2_model(path, precision.param_dtype, run.device)
    if ac:
        enable_gradient_checkpointing(model)
    model = apply_precision(model, precision, run.device)
    actor = ActorWorker.from_config(model, cfg)
    n = sum(p.numel() for p in model.parameters())
    c = model.config
    exp = random_batch(c.vocab_size, rows, prompt, response)
    actor.update(exp)  # warm-up: allocator, Adam state
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    s = _timed(lambda: actor.update(exp), run.device, reps=steps)
    peak = torch.cuda.max_memory_allocated() if run.device.type == "cuda" else 0
    tokens = rows * (prompt + response)
    tps = tokens / s
    flops = RESULTS.get("peaks", {}).get("matmul_flops")
    shape = TrainShape(
        params=n,
        trainable=n,
        hidden=c.hidden_size,
        layers=c.num_hidden_layers,
        vocab=c.vocab_size,
        tokens=micro * (prompt + response),
        response_share=response / (prompt + response),
        bf16=True,
        checkpointing=ac,
        optimizer="foreach",
    )
    pred = CALIBRATED.peak_bytes(shape)
    return {
        "params": n,
        "tokens_per_step": tokens,
        "micro_batch_rows": micro,
        "step_s": _r(s),
        "tokens_per_s": _r(tps),
        "mfu": _r(6 * n * tps / flops) if flops else None,
        "peak_gib": _r(peak / 2**30),
        "predicted_peak_gib": _r(pred / 2**30),
        "prediction_error": _r(pred / peak - 1) if peak else None,
    }


def step_update(size: str) -> Callable[[Run], dict[str, Any]]:
    def fn(run: Run) -> dict[str, Any]:
        cuda = run.device.type == "cuda"
        if not cuda:
            size_ = "tiny"
            kw = dict(rows=4, prompt=16, response=16, micro=2, steps=1)
        else:
            size_ = size
            kw = dict(rows=16, prompt=256, response=768, micro=8, steps=3)
        out: dict[str, Any] = {"config": size_}
        for ac in (False, True):
            figs = _update_figures(run, size_, ac, **kw)
            out["ac" if ac else "no_ac"] = figs
        out["ok"] = all(out[k]["tokens_per_s"] > 0 for k in ("ac", "no_ac"))
        return out

    return fn


def _decode_engine(model: Any, slots: int, graphs: bool) -> Any:
    """An engine over ``model``; ``graphs``: decode steps as CUDA graphs (on the CPU: the
    same static-buffer step run eagerly, ``DecodeGraphs(capture=False)``)."""
    from relayrl.rollout import RolloutEngine
    from relayrl.rollout.cuda_graphs import DecodeGraphs

    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    engine = RolloutEngine(
        model,
        eos_token_id=model.config.vocab_size + 7,
        pad_token_id=0,
        max_slots=slots,
        cuda_graphs=graphs and cuda,
    )
    if graphs and not cuda:
        engine.runner.graphs = DecodeGraphs(model, 0, slots, dev, capture=False)
    return engine


def _timed_generate(
    engine: Any, reqs: list[Any], device: torch.device
) -> tuple[list[Any], float, float]:
    """(samples, wall seconds, decode seconds: decode-only steps and their sampling)."""
    st0 = engine.stats()
    _sync(device)
    t0 = time.perf_counter()
    samples = engine.generate(reqs)
    _sync(device)
    wall = time.perf_counter() - t0
    st1 = engine.stats()
    dec_s = (st1["decode_time_s"] + st1["sample_time_s"]) - (
        st0["decode_time_s"] + st0["sample_time_s"]
    )
    return samples, wall, dec_s


def _compare(a: list[Any], b: list[Any]) -> dict[str, Any]:
    """Rows with the same tokens, and the largest logprob difference over those rows."""
    same = [(x, y) for x, y in zip(a, b, strict=True) if x.response_ids == y.response_ids]
    diffs = [
        abs(p - q)
        for x, y in same
        for p, q in zip(x.behaviour_logprobs, y.behaviour_logprobs, strict=True)
    ]
    return {
        "rows_tokens_equal": len(same),
        "rows": len(a),
        "logprob_max_abs_diff": _r(max(diffs)) if diffs else None,
        "logprobs_bitwise_equal": len(same) == len(a) and not any(diffs),
    }


GRAPH_STATS = (
    "cuda_graph_mode",
    "cuda_graph_captures",
    "cuda_graph_capture_s",
    "cuda_graph_replays",
    "cuda_graph_eager_steps",
    "cuda_graph_invalidations",
    "cuda_graphs_held",
    "cuda_graph_disabled",
)


def step_decode(run: Run) -> dict[str, Any]:
    """Own-engine decode at 1/32/256 rows, CUDA graphs off (eager) and on, against the HBM
    roofline and HF ``generate``; graphs' tokens against eager's; a graph replay against the
    same static step run eagerly (bitwise: what capture must not change)."""
    from relayrl.rollout import GenerationRequest
    from relayrl.rollout.cuda_graphs import DecodeGraphs
    from relayrl.rollout.types import SamplingParams

    cuda = run.device.type == "cuda"
    size = "0.5b" if cuda else "tiny"
    path = qwen2_dir(run, size)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = qwen2_model(path, dtype, run.device).eval().requires_grad_(False)
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    wbytes = n * (2 if cuda else 4)
    head_dim = c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * (2 if cuda else 4)
    bw = RESULTS.get("peaks", {}).get("copy_bytes_per_s")
    prompt, new = (64, 128) if cuda else (8, 8)
    rows_list = (1, 32, 256) if cuda else (1, 4)
    slots = max(rows_list)
    eager = _decode_engine(model, slots, graphs=False)
    graphed = _decode_engine(model, slots, graphs=True)
    g = torch.Generator().manual_seed(3)
    out: dict[str, Any] = {"config": size, "params": n, "prompt": prompt, "new_tokens": new}
    warm = [GenerationRequest([5] * prompt, SamplingParams(max_tokens=4))]
    eager.generate(warm)
    graphed.generate(warm)
    for rows in rows_list:
        prompts = [
            torch.randint(3, c.vocab_size, (prompt,), generator=g).tolist() for _ in range(rows)
        ]
        reqs = [
            GenerationRequest(p, SamplingParams(max_tokens=new, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts)
        ]
        samples, wall, dec_s = _timed_generate(eager, reqs, run.device)
        gen = sum(len(s.response_ids) for s in samples)
        dec_tokens = gen - rows  # the first token of each row comes from its prefill
        dec_tps = dec_tokens / dec_s if dec_s > 0 else 0.0
        # one decode step reads the weights once and every row's KV (mean context)
        step_bytes = wbytes + rows * (prompt + new / 2) * kv_per_token
        roof_tps = rows * bw / step_bytes if bw else None
        # graphs: a first run captures what these shapes need, the second is timed
        t0 = time.perf_counter()
        graphed.generate(reqs)
        first_s = time.perf_counter() - t0
        g_samples, g_wall, g_dec_s = _timed_generate(graphed, reqs, run.device)
        g_tps = (sum(len(s.response_ids) for s in g_samples) - rows) / g_dec_s if g_dec_s else 0.0
        ids = torch.tensor(prompts, device=run.device)
        model.generation_config.pad_token_id = 0
        hf_kw = dict(
            max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0, eos_token_id=None
        )
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=True, top_k=0, eos_token_id=None)
        _sync(run.device)
        t0 = time.perf_counter()
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), **hf_kw)
        _sync(run.device)
        hf_s = time.perf_counter() - t0
        hf_tokens = (hf.shape[1] - prompt) * rows
        out[f"rows_{rows}"] = {
            "engine_tokens_per_s": _r(gen / wall),
            "engine_decode_tokens_per_s": _r(dec_tps),
            "roofline_tokens_per_s": _r(roof_tps) if roof_tps else None,
            "roofline_fraction": _r(dec_tps / roof_tps) if roof_tps else None,
            "hf_generate_tokens_per_s": _r(hf_tokens / hf_s),
            "engine_over_hf": _r((gen / wall) / (hf_tokens / hf_s)),
            "graphs": {
                "engine_tokens_per_s": _r(sum(len(s.response_ids) for s in g_samples) / g_wall),
                "engine_decode_tokens_per_s": _r(g_tps),
                "decode_step_ms": _r(rows / g_tps * 1e3) if g_tps else None,
                "roofline_fraction": _r(g_tps / roof_tps) if roof_tps else None,
                "over_eager_decode": _r(g_tps / dec_tps) if dec_tps else None,
                "first_run_s": _r(first_s),
                "vs_eager": _compare(g_samples, samples),
            },
        }
    st = graphed.stats()
    out["graph_stats"] = {k: st.get(k) for k in GRAPH_STATS}
    # a graph replay against the same static step run eagerly (capture=False): the same
    # kernels on the same buffers, so the same bits (greedy and sampled rows)
    static = _decode_engine(model, slots, graphs=False)
    static.runner.graphs = DecodeGraphs(model, 0, slots, run.device, capture=False)
    check = [
        GenerationRequest(
            torch.randint(3, c.vocab_size, (prompt,), generator=g).tolist(),
            SamplingParams(
                max_tokens=new // 4, ignore_eos=True, seed=i, temperature=0.0 if i % 2 else 1.0
            ),
        )
        for i in range(min(32, slots))
    ]
    graphed_check = graphed.generate(check)
    out["graph_vs_static_eager"] = _compare(graphed_check, static.generate(check))
    out["graph_vs_static_eager"]["static_steps"] = static.stats()["cuda_graph_eager_steps"]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    versions = iter(range(1, 10))
    held = graphed.stats()["cuda_graphs_held"]
    graphed.update_weights(state, version=next(versions))
    s = _timed(lambda: graphed.update_weights(state, version=next(versions)), run.device, reps=3)
    out["weight_load_s_per_gb"] = _r(s / (nbytes / GB))
    out["weights_gb"] = _r(nbytes / GB)
    st = graphed.stats()
    # weights copied in place: the graphs stay, and still give the same tokens
    out["graphs_kept_after_update"] = st["cuda_graphs_held"] == held and held > 0
    out["graphs_same_after_update"] = _compare(graphed.generate(check), graphed_check)[
        "logprobs_bitwise_equal"
    ]
    out["ok"] = (
        all(out[f"rows_{r}"]["engine_tokens_per_s"] > 0 for r in rows_list)
        and all(out[f"rows_{r}"]["graphs"]["engine_tokens_per_s"] > 0 for r in rows_list)
        and st["cuda_graph_disabled"] is None
        and (st["cuda_graph_replays"] > 0 if cuda else st["cuda_graph_eager_steps"] > 0)
        and out["graph_vs_static_eager"]["logprobs_bitwise_equal"]
        and out["graphs_kept_after_update"]
        and out["graphs_same_after_update"]
    )
    return out


def _static_decode(
    model: Any, rows: int, prompt: int, steps: int, n: int, kv_per_token: int, bw: float | None
) -> dict[str, Any]:
    """One HF decode step (StaticCache) at ``rows``: eager ms, and CUDA-graph replay ms."""
    from transformers import StaticCache

    c = model.config
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    rec: dict[str, Any] = {}
    with torch.no_grad():
        cache = StaticCache(config=c, max_cache_len=prompt + 2 * steps + 8)
        ids = torch.randint(3, c.vocab_size, (rows, prompt), device=dev)
        model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            cache_position=torch.arange(prompt, device=dev),
        )
        tok = torch.randint(3, c.vocab_size, (rows, 1), device=dev)
        pos = torch.tensor([prompt], device=dev)

        def step() -> torch.Tensor:
            return model(
                input_ids=tok, past_key_values=cache, use_cache=True, cache_position=pos
            ).logits

        for _ in range(3):
            step()
            pos += 1
        eager = _timed(lambda: (step(), pos.add_(1)), dev, reps=steps)
        rec["eager_step_ms"] = _r(eager * 1e3)
        if cuda:
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        step()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                graph.replay()
                graphed = _timed(lambda: (graph.replay(), pos.add_(1)), dev, reps=steps)
                rec["graph_step_ms"] = _r(graphed * 1e3)
                rec["graph_speedup"] = _r(eager / graphed)
                ctx = prompt + steps
                ideal = (n * 2 + rows * ctx * kv_per_token) / bw if bw else None
                rec["graph_roofline_fraction"] = _r(ideal / graphed) if ideal else None
            except Exception as e:  # noqa: BLE001 - reported, the eager figure stands
                rec["graph_error"] = f"{type(e).__name__}: {e}"[:800]
    return rec


def step_launch(run: Run) -> dict[str, Any]:
    """Where a decode step's time goes: per-kernel launch cost, and one HF decode step
    (StaticCache) eager against its CUDA-graph replay, at 1 and 32 rows."""
    dev = run.device
    cuda = dev.type == "cuda"
    x = torch.zeros(16, device=dev)
    for _ in range(100):
        x.add_(1)
    launch_s = _timed(lambda: x.add_(1), dev, reps=2000)
    size = "0.5b" if cuda else "tiny"
    path = qwen2_dir(run, size)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = qwen2_model(path, dtype, dev).eval().requires_grad_(False)
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    head_dim = c.hidden_size // c.num_attention_heads
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * (2 if cuda else 4)
    bw = RESULTS.get("peaks", {}).get("copy_bytes_per_s")
    out: dict[str, Any] = {"launch_us": _r(launch_s * 1e6), "config": size}
    prompt, steps = 64, 32
    for rows in (1, 32):
        out[f"rows_{rows}"] = _static_decode(model, rows, prompt, steps, n, kv_per_token, bw)
    out["ok"] = not cuda or all("graph_step_ms" in out[f"rows_{r}"] for r in (1, 32))
    return out


# --------------------------------------------------------------------------- GRPO demo
