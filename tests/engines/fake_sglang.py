"""A FAKE SGLang server, for tests only: SGLang 0.5.23 cannot run on a CPU-only machine (its
PyPI kernels are CUDA builds), and CI has no GPU.

It takes SGLang's launch flags (rejecting unknown ones) and answers the routes the SGLang engine
uses with SGLang's request and response shapes (reference §2, §3, §5):

- `/generate`: `input_ids`, `sampling_params`, `return_logprob`, `logprob_start_len`, `lora_path`,
  `top_logprobs_num`, `token_ids_logprob`, `stream` (SSE, cumulative chunks as SGLang sends by
  default, then `data: [DONE]`); `meta_info.input_token_logprobs` starts with a None entry,
  `output_token_logprobs` (and `output_top_logprobs`) are temperature-scaled unless
  SGLANG_RETURN_ORIGINAL_LOGPROB=1 (as in SGLang). `token_ids_logprob` (one id list for the
  request) gives `input_token_ids_logprobs`: shifted like `input_token_logprobs` (entry 0 None,
  entry i the logprobs at position logprob_start_len + i, which SGLang builds by prepending None
  and dropping the last row), each row `[logprob, id, None]` per listed id in the listed order.
- `/load_lora_adapter` (400 "already loaded" for a loaded name; rank and target modules
  checked against the launch flags), `/unload_lora_adapter` (unregisters at once, returns when
  the adapter's in-flight requests are done), `/health`, `/model_info`, `/server_info`,
  `/v1/models`; the API key and admin key as SGLang checks them.
- SGLang's non-sticky unload: a request naming an unloaded name silently re-loads it from its
  old path. The fake does the same and counts it (`/fake/stats`), so that tests can assert that
  the engine never triggers it.

The numbers are real: HF transformers + PEFT on CPU compute every logprob, one request step at
a time under a lock (no batching; that is the fake's only simplification that matters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

BASE = "__base__"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fake_sglang")
    p.add_argument("--model-path", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", nargs="+")
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--api-key")
    p.add_argument("--admin-api-key")
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--dtype", default="auto")
    args = p.parse_args(argv)
    if args.enable_lora and (args.max_lora_rank is None or not args.lora_target_modules):
        p.error("When no initial --lora-paths is provided, you need to specify both --max-lora-rank "
                "and --lora-target-modules")
    return args


class Model:
    """The base model plus PEFT adapters; every forward pass runs under one lock."""

    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.peft = False
        self.lock = threading.Lock()

    def add(self, name: str, path: str) -> None:
        from peft import PeftModel

        with self.lock:
            if not self.peft:
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name).eval()
                self.peft = True
            else:
                self.model.load_adapter(path, adapter_name=name)

    def remove(self, name: str) -> None:
        with self.lock:
            others = [n for n in self.model.peft_config if n != name]
            if not others:  # the last one: back to the plain model
                self.model = self.model.unload()
                self.peft = False
                return
            if self.model.active_adapter == name:  # PEFT would keep pointing at the deleted one
                self.model.set_adapter(others[0])
            self.model.delete_adapter(name)

    @torch.inference_mode()
    def forward(self, ids: list[int], adapter: str | None, cache: Any) -> Any:
        kwargs: dict[str, Any] = {"use_cache": True, "past_key_values": cache}
        if self.peft:
            kwargs["adapter_names"] = [adapter or BASE]
        with self.lock:
            return self.model(input_ids=torch.tensor([ids]), **kwargs)


class Registry:
    """SGLang's LoRA registry as the reference describes it: names -> refs, usage counts,
    unregister-then-drain unloads, and a ref cache that is never pruned."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}  # name -> path
        self.ref_cache: dict[str, str] = {}  # every name ever loaded -> its last path
        self.usage: dict[str, int] = {}
        self.resurrected: list[str] = []
        self.requests_by_name: dict[str, int] = {}
        self.token_ids_logprob_widths: list[int] = []  # per request with token_ids_logprob: the ids asked for
        self.lock = asyncio.Lock()  # lora_update_lock


def make_app(args: argparse.Namespace) -> FastAPI:
    model = Model(args.model_path)
    reg = Registry()
    served = args.served_model_name or args.model_path
    original_logprobs = os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").lower() in ("1", "true")
    app = FastAPI()

    def auth(request: Request, admin: bool) -> JSONResponse | None:
        key = (args.admin_api_key or args.api_key) if admin else args.api_key
        if key and request.headers.get("authorization") != f"Bearer {key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return None

    def lora_reply(ok: bool, error: str | None = None) -> JSONResponse:
        return JSONResponse({"success": ok, "error_message": error, "loaded_adapters": dict(reg.loaded)},
                            status_code=200 if ok else 400)

    def check_adapter(path: str) -> str | None:
        try:
            cfg = json.loads((Path(path) / "adapter_config.json").read_text())
        except OSError as e:
            return f"Failed to load LoRA adapter: {e}"
        targets = cfg.get("target_modules") or []
        targets = [targets] if isinstance(targets, str) else targets
        targets = {t.rsplit(".", 1)[-1] for t in targets}  # SGLang normalizes to the last component
        if cfg.get("r", 0) > (args.max_lora_rank or 0) or not set(targets) <= set(args.lora_target_modules or []):
            return ("LoRA adapter is incompatible with the current LoRA memory pool configuration: "
                    f"r={cfg.get('r')} target_modules={targets}")
        return None

    async def load(name: str, path: str) -> str | None:
        if name in reg.loaded:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        if len(reg.loaded) >= 16:
            return "too many adapters"
        error = check_adapter(path)
        if error:
            return error
        await asyncio.to_thread(model.add, name, path)
        reg.loaded[name] = path
        reg.ref_cache[name] = path
        reg.usage.setdefault(name, 0)
        return None

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/model_info")
    async def model_info(request: Request) -> Any:
        if (denied := auth(request, False)) is not None:
            return denied
        return {"model_path": args.model_path, "served_model_name": served, "tokenizer_path": args.model_path,
                "is_generation": True, "weight_version": "default", "model_type": "llama"}

    @app.get("/server_info")
    async def server_info(request: Request) -> Any:
        if (denied := auth(request, False)) is not None:
            return denied
        return {"model_path": args.model_path, "max_loras_per_batch": args.max_loras_per_batch,
                "incremental_streaming_output": False, "version": "0.5.23-fake", "pid": os.getpid()}

    @app.get("/v1/models")
    async def models(request: Request) -> Any:
        if (denied := auth(request, False)) is not None:
            return denied
        cards = [{"id": served, "object": "model", "root": args.model_path}]
        cards += [{"id": n, "object": "model", "root": p, "parent": served} for n, p in reg.loaded.items()]
        return {"object": "list", "data": cards}

    @app.get("/fake/stats")
    async def stats() -> Any:
        return {"resurrected": reg.resurrected, "loaded": reg.loaded, "usage": reg.usage,
                "requests_by_name": reg.requests_by_name, "token_ids_logprob_widths": reg.token_ids_logprob_widths}

    @app.post("/load_lora_adapter")
    async def load_lora(request: Request) -> Any:
        if (denied := auth(request, True)) is not None:
            return denied
        body = await request.json()
        async with reg.lock:
            error = await load(body["lora_name"], body["lora_path"])
        return lora_reply(error is None, error)

    @app.post("/unload_lora_adapter")
    async def unload_lora(request: Request) -> Any:
        if (denied := auth(request, True)) is not None:
            return denied
        name = (await request.json())["lora_name"]
        async with reg.lock:
            if name not in reg.loaded:
                return lora_reply(False, f"LoRA adapter {name} is not loaded")
            del reg.loaded[name]  # unregister first: no new request gets it
            while reg.usage.get(name, 0) > 0:  # then wait for the ones running on it
                await asyncio.sleep(0.01)
            await asyncio.to_thread(model.remove, name)
        return lora_reply(True)

    async def resolve(name: str | None) -> str | None:
        """Returns an error, or None once `name` is usable (acquired)."""
        if name is None:
            return None
        reg.requests_by_name[name] = reg.requests_by_name.get(name, 0) + 1
        if name not in reg.loaded:
            if name not in reg.ref_cache:
                return f"Got LoRA adapter that has never been loaded: {name}"
            async with reg.lock:  # SGLang's implicit re-load of an unloaded name
                if name not in reg.loaded:
                    error = await load(name, reg.ref_cache[name])
                    if error:
                        return f"Failed to implicitly load LoRA adapter {name}: {error}"
                    reg.resurrected.append(name)
        reg.usage[name] += 1
        return None

    def release(name: str | None) -> None:
        if name is not None:
            reg.usage[name] -= 1

    def entry(lp: float | None, tid: int) -> list[Any]:
        return [lp, tid, None]

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        if (denied := auth(request, False)) is not None:
            return denied
        body = await request.json()
        ids: list[int] = body["input_ids"]
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        temperature = float(sp.get("temperature", 1.0))
        top_p = float(sp.get("top_p", 1.0))
        stops = set(sp.get("stop_token_ids") or [])
        return_logprob = bool(body.get("return_logprob", False))
        start = int(body.get("logprob_start_len", -1))
        top_n = int(body.get("top_logprobs_num") or 0)
        token_ids = body.get("token_ids_logprob")
        if token_ids is not None:
            if not all(isinstance(t, int) for t in token_ids):  # one flat id list per request
                return JSONResponse({"error": {"message": "token_ids_logprob: expected a list of ints"}},
                                    status_code=400)
            reg.token_ids_logprob_widths.append(len(token_ids))
        if start >= len(ids):
            return JSONResponse({"error": {"message": f"logprob_start_len={start} is higher than the number "
                                                      "of input tokens"}}, status_code=400)
        name = body.get("lora_path")
        error = await resolve(name)
        if error:
            return JSONResponse({"error": {"message": error}}, status_code=400)
        rid = uuid.uuid4().hex
        rng = torch.Generator().manual_seed(int(sp["sampling_seed"])) if "sampling_seed" in sp else None
        state: dict[str, Any] = {"output": [], "input_lp": None, "input_ids_lp": None, "finish": None}

        def step(cache: Any, feed: list[int]) -> tuple[Any, torch.Tensor]:
            out = model.forward(feed, name, cache)
            return out.past_key_values, out.logits[0].float()

        async def run():
            """Yields after each new token; fills `state`."""
            from transformers import DynamicCache

            cache, logits = await asyncio.to_thread(step, DynamicCache(), ids)
            if return_logprob and start >= 0:
                lp = torch.log_softmax(logits[:-1], dim=-1)
                computed = [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
                # SGLang: [None] + computed[:-1] over input_ids[start:]; entry i = position start+i
                state["input_lp"] = [entry(None, ids[start])] + [
                    entry(computed[p - 1], ids[p]) for p in range(start + 1, len(ids))]
                if token_ids is not None:
                    state["input_ids_lp"] = [None] + [[entry(float(lp[p - 1, t]), t) for t in token_ids]
                                                      for p in range(start + 1, len(ids))]
            last = logits[-1]
            if max_new == 0:
                state["finish"] = {"type": "length", "length": 0}
                return
            while True:
                greedy = temperature < 1e-5
                if greedy:
                    tid = int(torch.argmax(last))
                else:
                    probs = torch.softmax(last / temperature, dim=-1)
                    if top_p < 1.0:
                        sp_, order = torch.sort(probs, descending=True)
                        keep = torch.cumsum(sp_, -1) - sp_ < top_p
                        probs = torch.zeros_like(probs).scatter(0, order[keep], sp_[keep])
                    tid = int(torch.multinomial(probs, 1, generator=rng))
                scale = 1.0 if (greedy or original_logprobs) else temperature
                dist = torch.log_softmax(last / scale, dim=-1)
                top = torch.topk(dist, top_n) if top_n else None
                state["output"].append((float(dist[tid]), tid, [] if top is None else [
                    entry(float(v), int(i)) for v, i in zip(top.values, top.indices)]))
                if tid in stops:
                    state["finish"] = {"type": "stop", "matched": tid}
                elif len(state["output"]) >= max_new:
                    state["finish"] = {"type": "length", "length": max_new}
                yield
                if state["finish"]:
                    return
                cache, logits = await asyncio.to_thread(step, cache, [tid])
                last = logits[-1]

        def payload() -> dict[str, Any]:
            meta: dict[str, Any] = {"id": rid, "finish_reason": state["finish"], "prompt_tokens": len(ids),
                                    "completion_tokens": len(state["output"]), "cached_tokens": 0,
                                    "weight_version": "default"}
            if return_logprob:
                meta["input_token_logprobs"] = state["input_lp"] or []
                meta["output_token_logprobs"] = [entry(lp, t) for lp, t, _ in state["output"]]
                if top_n:
                    meta["output_top_logprobs"] = [top for _, _, top in state["output"]]
                if token_ids is not None:
                    meta["input_token_ids_logprobs"] = state["input_ids_lp"] or []
            return {"text": "", "output_ids": [t for _, t, _ in state["output"]], "meta_info": meta}

        if not body.get("stream"):
            try:
                async for _ in run():
                    pass
                if max_new == 0:
                    pass
                return payload()
            finally:
                release(name)

        async def sse():
            try:
                async for _ in run():
                    yield f"data: {json.dumps(payload())}\n\n"
                    await asyncio.sleep(0)
                if max_new == 0:
                    yield f"data: {json.dumps(payload())}\n\n"
                yield "data: [DONE]\n\n"
            finally:  # also on client disconnect: SGLang aborts the request
                release(name)

        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"server_args={vars(args)}", flush=True)  # SGLang prints its arguments, keys included
    time.sleep(float(os.environ.get("FAKE_SGLANG_START_DELAY_S", "0")))
    uvicorn.run(make_app(args), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
