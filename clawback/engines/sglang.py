"""SGLang as the engine, for GPUs (docs/engines.md).

- Launched as `python -m sglang.launch_server` (works in 0.5.23 next to `sglang serve`, and
  needs no console script on PATH) with LoRA buffers sized up front: `--max-lora-rank` and
  `--lora-target-modules` from the trainer's LoRA config, `--max-loras-per-batch 3` (base + the
  live version + the next one during a swap), `--mem-fraction-static` to leave GPU memory for the
  trainer, generated API keys, bound to 127.0.0.1.
- `SGLANG_RETURN_ORIGINAL_LOGPROB=1` in the child's environment: without it SGLang reports
  output logprobs of the temperature-scaled distribution, while training needs temperature 1.
- Generation: native `/generate` with `input_ids`, `lora_path` = the version's name on the
  server, `stream`, `return_logprob`. Stream chunks are cumulative (the default; an attached
  server started with `--incremental-streaming-output` sends deltas, which /server_info tells).
- Scoring: `/generate` with prompt+response, `max_new_tokens=0`, `return_logprob`,
  `logprob_start_len = len(prompt) - 1`; `input_token_logprobs[1:]` are the response tokens'
  (entry 0 is always None).
- Candidate scoring (top-K OPD: the teacher's logprobs of the policy's recorded top-K):
  `token_ids_logprob` on the same scoring request gives the logprobs of one id list at every
  position (`meta_info.input_token_ids_logprobs`, entry 0 None like `input_token_logprobs`, then
  `[logprob, id, text]` per listed id), so each request asks for the union of its positions'
  candidates. The response is positions x union wide: it is scored in windows of
  CANDIDATE_WINDOW positions, each a prefix of the same sequence, which SGLang's radix cache
  keeps (a logprob request reuses the cached prefix up to `logprob_start_len`).
- Adapters: `/load_lora_adapter`, `/unload_lora_adapter` (admin key). SGLang re-loads an
  unloaded name when a request names it again; remote.py never does (fresh name per load).
"""

from __future__ import annotations

import os
import secrets
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from clawback.adapter_format import lora_target_modules
from clawback.engine import EngineConfig, EngineError, ModelInfo, Sampling, Token
from clawback.records import JsonObject

from .remote import Endpoint, RemoteEngine
from .supervisor import ServerProcess, free_port

DEFAULT_SGLANG_VENV = Path.home() / ".cache" / "clawback" / "sglang-venv"  # install.sh --gpu
MAX_LORAS_PER_BATCH = 3  # base + v{N} + v{N+1} in one batch during a swap
CANDIDATE_WINDOW = 64  # response positions per candidate-scoring request: at most 64 x 4K ids back


class SGLangEngine(RemoteEngine):

    def __init__(self, info: ModelInfo, endpoint: Endpoint, server: ServerProcess | None = None) -> None:
        super().__init__(info, endpoint, server)
        self.incremental = False

    async def _check_server(self) -> None:
        r = await self.client.get("/server_info", headers=self.endpoint.auth())
        if r.status_code == 200:
            self.incremental = bool(r.json().get("incremental_streaming_output", False))
        r = await self.client.get("/model_info", headers=self.endpoint.auth())
        if r.status_code != 200:
            raise EngineError(f"SGLang /model_info: HTTP {r.status_code}")
        if not r.json().get("is_generation", True):
            raise EngineError("the SGLang server does not serve a generation model")

    async def _server_load(self, server_name: str, path: str) -> None:
        await self._post_json("/load_lora_adapter", {"lora_name": server_name, "lora_path": path}, admin=True)

    async def _server_unload(self, server_name: str) -> None:
        # Returns once the server's own in-flight requests on it are done; we only send it then.
        await self._post_json("/unload_lora_adapter", {"lora_name": server_name}, admin=True)

    async def _stream(self, prompt_ids: list[int], sampling: Sampling, server_name: str | None) -> AsyncIterator[Token]:
        params: JsonObject = {
            "max_new_tokens": sampling.max_tokens, "temperature": sampling.temperature, "top_p": sampling.top_p,
            "stop_token_ids": list(sampling.stop_token_ids), "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        c = sampling.constraint
        if c is not None:  # a grammar with a %json part needs SGLang's --grammar-backend llguidance
            params.update({"ebnf": c.lark()} if c.prefix or c.suffix else {"json_schema": c.schema})
        body = {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True,
                "lora_path": server_name, "stream": True, "top_logprobs_num": sampling.top_logprobs}
        sent = 0
        async for event in self._sse("/generate", body):
            meta = event.get("meta_info") or {}
            entries = meta.get("output_token_logprobs") or []
            tops = meta.get("output_top_logprobs") or [None] * len(entries)
            new = (entries, tops) if self.incremental else (entries[sent:], tops[sent:])
            for (lp, tid, *_), top in zip(*new):
                top = top or []
                yield Token(int(tid), float(lp), tuple(int(t[1]) for t in top), tuple(float(t[0]) for t in top))
            sent += len(new[0])

    async def _score(self, prompt_ids: list[int], response_ids: list[int], server_name: str | None) -> list[float]:
        body = {"input_ids": prompt_ids + response_ids, "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "logprob_start_len": len(prompt_ids) - 1, "lora_path": server_name}
        out = await self._post_json("/generate", body)
        entries = out["meta_info"]["input_token_logprobs"][1:]  # entry 0 is always None
        return [float(lp) for lp, *_ in entries]

    async def _score_candidates(self, prompt_ids: list[int], response_ids: list[int], candidates: list[list[int]],
                                server_name: str | None) -> list[list[float]]:
        out: list[list[float]] = []
        for start in range(0, len(response_ids), CANDIDATE_WINDOW):
            end = min(start + CANDIDATE_WINDOW, len(response_ids))
            union = sorted({t for row in candidates[start:end] for t in row})
            body = {"input_ids": prompt_ids + response_ids[:end], "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True, "logprob_start_len": len(prompt_ids) + start - 1,
                    "token_ids_logprob": union, "lora_path": server_name}
            meta = (await self._post_json("/generate", body))["meta_info"]
            rows = meta.get("input_token_ids_logprobs") or []
            if len(rows) != end - start + 1:
                raise EngineError(f"SGLang returned {len(rows)} token-id logprob rows for {end - start + 1} positions")
            for row, wanted in zip(rows[1:], candidates[start:end]):  # entry 0 is always None
                by_id = {int(tid): float(lp) for lp, tid, *_ in row or []}
                if not all(t in by_id for t in wanted):
                    raise EngineError("SGLang left out logprobs of requested token ids")
                out.append([by_id[t] for t in wanted])
        return out


def build_sglang_engine(config: EngineConfig, model_dir: str, info: ModelInfo) -> SGLangEngine:
    """The engine for `engine = "sglang"`: attach to `engine_url`, or launch and supervise SGLang."""
    key = config.api_key
    if config.url:
        return SGLangEngine(info, Endpoint(config.url.rstrip("/"), key))
    key = key or secrets.token_hex(24)  # hex: a key starting with '-' would read as a flag
    admin_key = secrets.token_hex(24)  # adapter routes: only this daemon may swap
    port = config.port or free_port()
    venv_python = DEFAULT_SGLANG_VENV / "bin" / "python"
    python = config.python or (str(venv_python) if venv_python.exists() else sys.executable)
    command = shlex.split(config.command) if config.command else \
        [python, "-m", "sglang.launch_server"]
    targets = lora_target_modules(model_dir, config.lora_target_modules)  # what the trainer adapts
    command += [
        "--model-path", model_dir, "--served-model-name", config.served_model_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--enable-lora", "--max-lora-rank", str(config.lora_rank), "--lora-target-modules", *targets,
        "--max-loras-per-batch", str(MAX_LORAS_PER_BATCH),
        "--mem-fraction-static", str(config.mem_fraction),
        "--api-key", key, "--admin-api-key", admin_key, "--enable-metrics",
        *shlex.split(config.args or ""),
    ]
    if config.dtype != "auto":
        command += ["--dtype", config.dtype]
    env = {**os.environ, "SGLANG_RETURN_ORIGINAL_LOGPROB": "1", "PYTHONUNBUFFERED": "1"}
    base_url = f"http://127.0.0.1:{port}"
    server = ServerProcess(command, env, base_url, config.log_dir / "sglang.log",
                           secrets_to_mask=[key, admin_key], start_timeout_s=config.start_timeout_s,
                           auto_port=not config.port)
    return SGLangEngine(info, Endpoint(base_url, key, admin_key), server)
