"""One script for a lent GPU: does the one-card home layout fit, and how fast is it?

1. `qwen3-4b`: a randomly initialised model with Qwen3-4B's shapes (no download), bf16, with the
   process capped at `--cap-gb` (default 24 GB, a home card) through
   torch.cuda.set_per_process_memory_fraction. LoRA rank 16 on every linear layer, AdamW, and
   clawback's own `train_step` at the default token budget (16 samples × 512 tokens = 8192 tokens,
   one micro-batch), with and without gradient checkpointing, plus longer samples (4 × 2048
   tokens). Reports step time, tokens/s and peak memory (or the OOM) per setting.
2. `smollm2`: SmolLM2-135M's shapes (random weights; the engine works on token ids, so no
   tokenizer is needed) through the embedded engine on CUDA: single-stream and 8-stream decode
   speed, a training step and an atomic publish, and a hot-swap (validate + load + activate)
   while 8 streams run, with the longest token gap during the swap against the longest before it.

Each section runs on its own; an error is recorded and the next one runs. Prints a summary and
writes gpu_check.json into --out (default: $OUT if set, else bench/results/).

    python bench/gpu_check.py                       # on the lent GPU
    python bench/gpu_check.py --smoke --device cpu  # tiny shapes, CPU: checks the script itself
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from clawback.adapter_format import publish, validate
from clawback.engine import Sampling
from clawback.engines.embedded import EmbeddedEngine
from clawback.trainer.config import TrainConfig
from clawback.trainer.step import Sample, make_lora_model, make_optimizer, train_step

GiB = 2**30

# Qwen/Qwen3-4B config.json (the shapes are what matter; weights are random).
QWEN3_4B = dict(
    vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
# HuggingFaceTB/SmolLM2-135M-Instruct config.json.
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)
TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
)


def random_samples(n: int, prompt_len: int, response_len: int, vocab: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(
        prompt_ids=torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
        response_ids=torch.randint(0, vocab, (response_len,), generator=g).tolist(),
        behaviour_logprobs=(-3 + torch.randn(response_len, generator=g)).tolist(),
        reward=1.0 if i % 2 else -1.0,
        teacher_logprobs=(-3 + torch.randn(response_len, generator=g)).tolist(),
    ) for i in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GiB if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def build(shapes: dict[str, Any], family: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config = (Qwen3Config if family == "qwen3" else LlamaConfig)(**shapes)
    torch.manual_seed(0)
    with device:  # initialise on the device: a 4B model on the CPU first takes minutes
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def train_settings(smoke: bool) -> list[dict[str, Any]]:
    # (samples, prompt, response): the default batch is 16 samples in one 8192-token micro-batch.
    if smoke:
        return [dict(name="default-budget", n=4, prompt=24, response=8, checkpointing=True),
                dict(name="no-checkpointing", n=4, prompt=24, response=8, checkpointing=False)]
    return [
        dict(name="16x512 checkpointing", n=16, prompt=384, response=128, checkpointing=True),
        dict(name="16x512 no checkpointing", n=16, prompt=384, response=128, checkpointing=False),
        dict(name="4x2048 checkpointing", n=4, prompt=1536, response=512, checkpointing=True),
        dict(name="16x2048 checkpointing (4 micro-batches)", n=16, prompt=1536, response=512, checkpointing=True),
        # Smaller micro-batches: what the trainer needs beside a serving engine on one 24 GB card.
        dict(name="16x512 checkpointing, budget 4096", n=16, prompt=384, response=128, checkpointing=True, budget=4096),
        dict(name="16x512 checkpointing, budget 2048", n=16, prompt=384, response=128, checkpointing=True, budget=2048),
    ]


def section_qwen3(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    shapes = TINY if args.smoke else QWEN3_4B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict[str, Any] = {"shapes": shapes, "dtype": str(dtype), "settings": []}
    for setting in train_settings(args.smoke):
        if args.only and args.only not in setting["name"]:
            continue
        reset_peak(device)
        row: dict[str, Any] = dict(setting)
        base = model = opt = None
        try:
            t0 = time.perf_counter()
            base = build(shapes, "qwen3", device, dtype)
            sync(device)
            row["build_s"] = time.perf_counter() - t0
            row["params"] = sum(p.numel() for p in base.parameters())
            row["weights_gib"] = sum(p.numel() * p.element_size() for p in base.parameters()) / GiB
            cfg = TrainConfig(lora_rank=16, lora_alpha=32, gradient_checkpointing=setting["checkpointing"],
                              micro_batch_tokens=setting.get("budget", 8192))
            model = make_lora_model(base, cfg)
            opt = make_optimizer(model, cfg)
            row["lora_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
            samples = random_samples(setting["n"], setting["prompt"], setting["response"], shapes["vocab_size"], 0)
            times, tps = [], []
            for i in range(1 + args.reps):  # first step warms up (kernels, allocator, optimizer state)
                sync(device)
                m = train_step(model, opt, samples, cfg)
                sync(device)
                if i:
                    times.append(m["step_time_s"])
                    tps.append(m["tokens_per_s"])
            row.update(step_s=statistics.median(times), tokens_per_s=statistics.median(tps),
                       step_s_all=times, micro_batches=m["micro_batches"], tokens=m["tokens"],
                       peak_gib=peak_gib(device), fits=True)
        except torch.OutOfMemoryError as e:
            row.update(fits=False, error=f"OOM: {str(e).splitlines()[0]}", peak_gib=peak_gib(device))
        except Exception as e:
            row.update(fits=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
        finally:
            del base, model, opt  # all three, or the next setting measures two models
            reset_peak(device)
        print(f"  qwen3 {row['name']}: " + (
            f"{row['step_s']:.2f} s/step, {row['tokens_per_s']:.0f} tok/s, peak {row['peak_gib']}"
            if row.get("fits") else row.get("error", "")), flush=True)
        out["settings"].append(row)
    return out


async def _stream(engine: EmbeddedEngine, prompt: list[int], max_tokens: int, adapter: str | None,
                  stamps: list[float]) -> int:
    n = 0
    async for _ in engine.generate(prompt, Sampling(temperature=1.0, max_tokens=max_tokens, seed=n), adapter):
        stamps.append(time.perf_counter())
        n += 1
    return n


def plain_decode(engine: EmbeddedEngine, prompt: list[int], tokens: int) -> dict[str, float]:
    """The same per-token work as the engine (forward, log_softmax, sample) in a bare loop, on
    this thread: the floor the engine's own scheduling adds to."""
    from transformers import DynamicCache

    model, device = engine.model, engine.device
    with torch.inference_mode():
        cache, ids = DynamicCache(), prompt
        t0 = time.perf_counter()
        for _ in range(tokens):
            out = model(input_ids=torch.tensor([ids], device=device), use_cache=True,
                        **{engine._cache_arg: cache})
            cache = getattr(out, engine._cache_arg)
            logits = out.logits[0, -1].float()
            token = int(torch.multinomial(torch.softmax(logits, -1), 1))
            float(torch.log_softmax(logits, -1)[token])
            ids = [token]
        wall = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": wall, "ms_per_token": 1000 * wall / tokens}


def max_gap(stamps: list[float], start: float, end: float) -> float:
    """Longest gap between consecutive tokens of one stream that overlaps [start, end]."""
    return max((b - a for a, b in zip(stamps, stamps[1:]) if b >= start and a <= end), default=0.0)


async def section_smollm2_async(args: argparse.Namespace, device: torch.device, tmp: Path) -> dict[str, Any]:
    shapes = TINY if args.smoke else SMOLLM2_135M
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = tmp / "smollm2-shapes"
    build(shapes, "llama", torch.device("cpu"), dtype).save_pretrained(str(model_dir))
    out: dict[str, Any] = {"shapes": shapes, "dtype": str(dtype)}
    engine = EmbeddedEngine(model_dir, device=str(device), dtype=str(dtype).removeprefix("torch."))
    tokens = 32 if args.smoke else 128
    prompt = list(range(10, 10 + (32 if args.smoke else 256)))
    try:
        await _stream(engine, prompt, 8, None, [])  # warm-up
        out["plain_hf_decode"] = await asyncio.to_thread(plain_decode, engine, prompt, tokens)
        print(f"  smollm2 plain HF decode (no engine): {out['plain_hf_decode']['ms_per_token']:.1f} ms/token", flush=True)
        for streams in (1, 8):
            stamps: list[list[float]] = [[] for _ in range(streams)]
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(_stream(engine, prompt, tokens, None, s) for s in stamps))
            wall = time.perf_counter() - t0
            out[f"decode_{streams}_streams"] = dict(
                tokens=sum(counts), wall_s=wall, tokens_per_s=sum(counts) / wall,
                ttft_s=statistics.median(s[0] - t0 for s in stamps))
            print(f"  smollm2 decode x{streams}: {sum(counts) / wall:.0f} tok/s", flush=True)

        # A training step on the same shapes, published atomically like the trainer actor does.
        cfg = TrainConfig(lora_rank=16, lora_alpha=32)
        base = build(shapes, "llama", device, dtype)
        model = make_lora_model(base, cfg)
        opt = make_optimizer(model, cfg)
        samples = random_samples(16, len(prompt), 64, shapes["vocab_size"], 1)
        steps = [train_step(model, opt, samples, cfg) for _ in range(1 + args.reps)][1:]
        t0 = time.perf_counter()
        path = publish(tmp / "adapters", 1, model, opt, {"bench": "gpu_check"})
        out["train"] = dict(step_s=statistics.median(m["step_time_s"] for m in steps),
                            tokens_per_s=statistics.median(m["tokens_per_s"] for m in steps),
                            publish_s=time.perf_counter() - t0, peak_gib=peak_gib(device))
        print(f"  smollm2 train: {out['train']['step_s']:.3f} s/step", flush=True)
        del model, opt, base
        reset_peak(device)

        # Hot-swap while 8 streams run: the gap a swap adds to streams already in flight.
        stamps = [[] for _ in range(8)]
        long_tokens = 64 if args.smoke else 96
        tasks = [asyncio.create_task(_stream(engine, prompt, long_tokens, None, s)) for s in stamps]
        await asyncio.sleep(0.05 if args.smoke else 1.0)
        before_end = time.perf_counter()
        t_swap = time.perf_counter()
        validate(path)
        await engine.load_adapter("v1", str(path))
        t_loaded = time.perf_counter()
        await engine.activate("v1")
        t_live = time.perf_counter()
        after = [[] for _ in range(2)]
        tasks += [asyncio.create_task(_stream(engine, prompt, 16, "v1", s)) for s in after]
        await asyncio.gather(*tasks)
        all_stamps = sorted(t for s in stamps for t in s)
        before_start = all_stamps[0] if all_stamps else before_end
        gaps_before = [max_gap(s, before_start, before_end) for s in stamps]
        gaps_swap = [max_gap(s, t_swap, t_live) for s in stamps]
        out["swap"] = dict(load_s=t_loaded - t_swap, activate_s=t_live - t_loaded, swap_s=t_live - t_swap,
                           max_gap_before_s=max(gaps_before), max_gap_during_swap_s=max(gaps_swap),
                           new_version_tokens=sum(len(s) for s in after))
        print(f"  smollm2 swap: {out['swap']['swap_s'] * 1000:.0f} ms, max gap "
              f"{max(gaps_before) * 1000:.0f} ms before / {max(gaps_swap) * 1000:.0f} ms during", flush=True)
    finally:
        await engine.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cap-gb", type=float, default=24.0, help="memory cap of the process (a home card)")
    ap.add_argument("--reps", type=int, default=3, help="timed training steps per setting (after 1 warm-up)")
    ap.add_argument("--sections", default="qwen3,smollm2")
    ap.add_argument("--only", default="", help="run only the training settings whose name contains this")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: check the script, not the GPU")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or Path(__file__).parent / "results"))
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "host": platform.node(), "python": sys.version.split()[0],
        "torch": torch.__version__, "cap_gb": args.cap_gb, "smoke": args.smoke,
    }
    try:
        import peft
        import transformers
        report.update(transformers=transformers.__version__, peft=peft.__version__)
    except ImportError:
        pass
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * GiB / total), device)
        report.update(gpu=torch.cuda.get_device_name(device), gpu_total_gib=total / GiB)
        torch.backends.cuda.matmul.allow_tf32 = True
    print(json.dumps({k: v for k, v in report.items()}), flush=True)
    sections = args.sections.split(",")
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name in sections:
            t0 = time.perf_counter()
            print(f"== {name}", flush=True)
            try:
                if name == "qwen3":
                    report[name] = section_qwen3(args, device)
                elif name == "smollm2":
                    report[name] = asyncio.run(section_smollm2_async(args, device, Path(tmp)))
                else:
                    raise ValueError(f"unknown section {name}")
            except Exception as e:
                report[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
                print(report[name]["trace"], flush=True)
            report[name]["section_s"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("gpu_check-smoke.json" if args.smoke else "gpu_check.json")
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")
    return 0 if all("error" not in report[n] for n in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
