"""Chat completions: render the request once, stream tokens from the engine as they are sampled,
and hand the finished call to capture, which queues it for the store; nothing here waits on the
disk, the judge or the trainer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Literal, NotRequired, TypedDict, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.types import Receive, Scope, Send

from clawback.chat import ChatRequest
from clawback.engine import EngineError, Sampling, Token
from clawback.records import Call, JsonObject, Version
from clawback.replies import IncrementalDetokenizer, TextGate, ToolCall, parse_tool_calls

from ...engines import grammar
from ..capture import CallMeta, MetaError, parse_meta, random_id
from ..memory import inject
from ..store import StoreBusy
from .errors import CLIENT_GONE, ApiError, read_json, validation_error
from .state import AppState

T = TypeVar("T")


class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(TypedDict):
    """A choice's OpenAI `logprobs`."""
    content: list[TokenLogprob]


class ReplyMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None
    tool_calls: NotRequired[list[ToolCall]]


IMAGE_PARTS = ("image_url", "input_image", "image")


def refuse_images(raw: JsonObject) -> None:
    """Image content parts get a plain answer rather than a schema path."""
    messages = raw.get("messages")
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        content = m.get("content") if isinstance(m, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                raise ApiError(400, "this model does not accept images", param=f"messages.{i}.content.{j}",
                               code="images_not_supported")


# A prompt this small renders in well under a millisecond, less than the hop to a worker thread
# costs; bigger ones (agent prompts with long system prompts and tool lists) render off the loop.
INLINE_RENDER_BYTES = 16 * 1024


@dataclass
class _Prepared:
    req: ChatRequest  # as received (session pairing compares what the client sent)
    served: ChatRequest  # as rendered for the model: with the preference notes, when any
    meta: CallMeta
    prompt_text: str
    prompt_ids: list[int]
    sampling: Sampling
    adapter: str | None
    call_id: str
    arrived: float
    rendered: float


async def _prepare(state: AppState, request: Request) -> _Prepared:
    arrived = time.time()
    raw = await read_json(request, state.settings.max_body_bytes)
    if not isinstance(raw, dict):
        raise ApiError(400, "request body must be a JSON object", code="invalid_json")
    refuse_images(raw)
    try:
        req = ChatRequest.model_validate(raw)
    except ValidationError as e:
        raise validation_error(e) from None
    if req.model_extra:
        name = next(iter(req.model_extra))
        raise ApiError(400, f"unknown field {name!r}: this server does not know what it asks for, so it refuses it "
                            "rather than ignore it", param=name, code="unknown_parameter")
    if (name := req.not_implemented()) is not None:
        raise ApiError(400, f"{name} is not supported: only its default (no effect) is accepted", param=name,
                       code="unsupported_parameter")
    if (req.n or 1) > 1:
        raise ApiError(400, "n > 1 is not supported: each reply is its own call; send n requests",
                       param="n", code="unsupported_parameter")
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
    constraint = req.constraint()
    if constraint is not None:
        error = await asyncio.to_thread(grammar.check, constraint)
        if error:
            param = "tools" if constraint.prefix else "response_format"
            raise ApiError(400, f"cannot enforce this schema: {error.strip()}", param=param, code="invalid_schema")
    if req.model not in (state.settings.served_model_name, state.engine.info.name):
        raise ApiError(404, f"model {req.model!r} does not exist; this daemon serves "
                            f"{state.settings.served_model_name!r}", param="model", code="model_not_found")
    try:
        meta = parse_meta(request.headers, req)
    except MetaError as e:
        raise ApiError(400, str(e), param=e.param, code="invalid_value") from None
    adapter = state.engine.active_version()
    served, prompt_text, prompt_ids = await _render(state, request, req, meta, adapter)
    if state.engine.active_version() != adapter:  # a version went live meanwhile: serve it, with its notes
        adapter = state.engine.active_version()
        served, prompt_text, prompt_ids = await _render(state, request, req, meta, adapter)
    ctx = state.engine.info.context_length
    if len(prompt_ids) >= ctx:
        raise ApiError(400, f"This model's maximum context length is {ctx} tokens. However, your messages "
                            f"resulted in {len(prompt_ids)} tokens. Please reduce the length of the messages.",
                       param="messages", code="context_length_exceeded")
    wanted = req.max_completion_tokens or req.max_tokens or state.settings.default_max_tokens
    sampling = Sampling(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_tokens=min(wanted, ctx - len(prompt_ids)),  # the room left in the context
        seed=req.seed,
        stop_token_ids=state.engine.info.eos_token_ids,
        # Main calls keep the policy's top-K per token too, for top-K OPD's teacher to score.
        top_logprobs=max(req.top_logprobs or 0, state.opd_top_k if meta.turn_type == "main" else 0),
        constraint=constraint,
    )
    return _Prepared(req, served, meta, prompt_text, prompt_ids, sampling, adapter,
                     f"chatcmpl-{random_id()}", arrived, time.time())


async def _render(state: AppState, request: Request, req: ChatRequest, meta: CallMeta,
                  adapter: str | None) -> tuple[ChatRequest, str, list[int]]:
    """The request as served to `adapter` (main calls get the person's preference notes that are
    active for it, the general ones and their conversation's, in the message `memory_placement`
    names; the request is stored as served) and its prompt."""
    served = req if req.memory_notes is None else req.model_copy(update={"memory_notes": None})
    if meta.turn_type == "main" and state.settings.memory:
        notes = await state.store.note_texts(Version.of(adapter), meta.session_id)
        if notes:
            body = served.model_dump(exclude_none=True)
            served = ChatRequest.model_validate({**body, "memory_notes": notes, "messages": inject(
                body["messages"], notes, state.settings.memory_placement)})
    try:
        length = request.headers.get("content-length", "")  # absent when chunked: render off the loop
        if length.isdigit() and len(length) <= 6 and int(length) < INLINE_RENDER_BYTES:
            prompt_text, prompt_ids = state.renderer.render(served)
        else:
            prompt_text, prompt_ids = await asyncio.to_thread(state.renderer.render, served)
    except Exception as e:  # the chat template rejected this conversation (role order etc.)
        raise ApiError(400, f"the model's chat template cannot render these messages: {e}",
                       param="messages", code="invalid_messages") from None
    return served, prompt_text, prompt_ids


def _top_matrix(rows: list[list[T]]) -> list[list[T]] | None:
    """T x K `top_ids` or `top_logprobs`; None unless every position has the same K > 0."""
    widths = {len(r) for r in rows}
    return rows if len(widths) == 1 and 0 not in widths else None


def _sampling_logprobs(tokens: list[Token]) -> list[float] | None:
    """Each token's logprob under the distribution it was drawn from; None if any is unknown (greedy)."""
    values = [t.sampling_logprob for t in tokens]
    return None if not values or None in values else [float(v) for v in values if v is not None]


class _Run:
    """One generation: tokens in, text deltas out, and the record for the store at the end."""

    def __init__(self, state: AppState, p: _Prepared) -> None:
        self.state, self.p = state, p
        self.detok = IncrementalDetokenizer(state.renderer.tokenizer)
        self.gate = TextGate(p.req.stop_list(), p.req.tools_enabled())
        self.tokens: list[Token] = []
        self.first_token_at: float | None = None
        self.finish_reason = "cancelled"
        self.tool_calls: list[ToolCall] = []
        self.content: str | None = None
        self.finished = False

    async def deltas(self) -> AsyncIterator[str]:
        eos = set(self.p.sampling.stop_token_ids)
        stream = self.state.engine.generate(self.p.prompt_ids, self.p.sampling, self.p.adapter)
        try:
            async for tok in stream:
                if self.first_token_at is None:
                    self.first_token_at = time.time()
                self.tokens.append(tok)
                if tok.id in eos:
                    break
                out = self.gate.feed(self.detok.push(tok.id))
                if out:
                    yield out
                if self.gate.stopped:
                    break
        finally:
            await stream.aclose()  # stops the engine early on a stop string or a client disconnect
        hit_eos = bool(self.tokens) and self.tokens[-1].id in eos
        tail = self.gate.finish()
        if tail:
            yield tail
        self.finish_reason = "stop" if (hit_eos or self.gate.stopped) else "length"
        if self.gate.tool_text:
            self.content, self.tool_calls = parse_tool_calls(self.gate.text, self.p.req.tool_names())
            if self.tool_calls:
                self.finish_reason = "tool_calls"
            else:  # held back as a possible call and not one: the client gets it as content
                yield self.gate.tool_text
        else:
            self.content = self.gate.content

    def logprobs_content(self) -> ChoiceLogprobs | None:
        """OpenAI `logprobs.content` for every sampled token (the end token included)."""
        if not self.p.req.logprobs:
            return None
        decode = self.state.renderer.tokenizer.decode

        def entry(token_id: int, lp: float) -> TopLogprob:
            text = decode([token_id])
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}

        n = self.p.req.top_logprobs or 0  # the engine may hold more: main calls keep top-K for OPD
        return {"content": [TokenLogprob(**entry(t.id, t.logprob),
                                         top_logprobs=[entry(i, lp) for i, lp in zip(t.top_ids[:n], t.top_logprobs[:n])])
                            for t in self.tokens]}

    @property
    def ids(self) -> list[int]:
        return [t.id for t in self.tokens]

    def usage(self) -> dict[str, int]:
        n_prompt, n_out = len(self.p.prompt_ids), len(self.ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def record(self) -> Call:
        p, now = self.p, time.time()
        ttft = (self.first_token_at or now) - p.arrived
        return Call(
            call_id=p.call_id, session_id=p.meta.session_id, turn_id=p.meta.turn_id,
            request_id=p.meta.request_id, turn_type=p.meta.turn_type, state="served",
            created_at=p.arrived, finished_at=now, model=self.state.engine.info.name,
            adapter_version=Version.of(p.adapter), request=p.served.openai_body(), prompt_text=p.prompt_text,
            prompt_ids=p.prompt_ids, response_ids=self.ids, behaviour_logprobs=[t.logprob for t in self.tokens],
            sampling_logprobs=_sampling_logprobs(self.tokens), top_ids=_top_matrix([list(t.top_ids) for t in self.tokens]),
            top_logprobs=_top_matrix([list(t.top_logprobs) for t in self.tokens]),
            response_text=self.gate.text, tool_calls=self.tool_calls or None,
            finish_reason=self.finish_reason,
            timings={"render_s": p.rendered - p.arrived, "ttft_s": ttft, "total_s": now - p.arrived,
                     "completion_tokens": len(self.ids)},
        )

    def finish(self) -> None:
        """Hands the call to capture; runs once (more calls are no-ops), also when the client went
        away mid-stream."""
        if self.finished:
            return
        self.finished = True
        s = self.state
        s.count_running(-1)
        rec = self.record()
        s.capture.finish(self.p.meta, rec, self.p.req)
        s.calls.labels(self.p.meta.turn_type).inc()
        s.tokens.labels("prompt").inc(len(self.p.prompt_ids))
        s.tokens.labels("completion").inc(len(self.ids))
        s.ttft.observe(rec.timings["ttft_s"])
        s.latency.labels(str(self.p.req.stream).lower()).observe(rec.timings["total_s"])

    async def before_reply(self) -> None:
        """Runs before the client gets the end of its reply. A main call is handed to capture and
        committed first, so that a reply the client has is never lost to a crash. A side call is
        never trained: it is handed over after the reply (`finish` then), which keeps its
        bookkeeping and the store writer's wake-up off the reply's path."""
        if self.p.meta.turn_type == "main":
            self.finish()
            with contextlib.suppress(StoreBusy):  # the call was dropped and counted, not lost unseen
                await self.state.store.committed()


class _ReplyThen(JSONResponse):
    """A JSON reply, then `then()`: work the client need not wait for (also when sending failed)."""

    def __init__(self, content: object, headers: dict[str, str], then: Callable[[], None]) -> None:
        super().__init__(content, headers=headers)
        self.then = then

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.then()


class _EventStream(Response):
    """Server-sent events, each sent as soon as it is made. Starlette's StreamingResponse does the
    same through an anyio task group and a wrapper per chunk; here one task watches for the client
    going away, which cancels the stream and so stops the generation."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        self.events, self.status_code, self.background = events, 200, None
        self.init_headers(headers)  # no body: no content-length, so uvicorn sends it chunked

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        await _unless_client_gone(stream(), receive)  # cancelled, the engine stops and the call is stored




async def _generate(run: _Run) -> None:
    async for _ in run.deltas():
        pass
    await run.before_reply()


async def _client_gone(receive: Receive) -> None:
    """Returns when the client closes its connection (uvicorn reports that on `receive`; `send`
    does not fail). Only after the request body was read: until then `receive` returns it."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_client_gone(work: Coroutine[object, object, None], receive: Receive) -> bool:
    """Run `work` until it is done (True) or the client goes away (False: `work` is cancelled,
    its cleanup done)."""
    working, watching = asyncio.ensure_future(work), asyncio.ensure_future(_client_gone(receive))
    try:
        await asyncio.wait((working, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        working.cancel()  # a no-op once it is done
    await asyncio.wait((working,))
    if working.cancelled():
        return False
    if (error := working.exception()) is not None:
        raise error
    return True


def _headers(p: _Prepared) -> dict[str, str]:
    return {"x-request-id": p.meta.request_id, "x-clawback-call-id": p.call_id,
            "x-clawback-adapter": p.adapter or "base"}


async def serve_chat(state: AppState, request: Request) -> Response:
    p = await _prepare(state, request)
    await state.capture.begin(p.meta, p.req, p.call_id)
    state.count_running(+1)
    run = _Run(state, p)
    if p.req.stream:
        return _EventStream(_sse(state, run), headers={**_headers(p), "cache-control": "no-cache"})
    try:
        if not await _unless_client_gone(_generate(run), request.receive):
            # Stopped where the client left; what was generated is stored, as a cancelled call.
            run.finish()
            return Response(status_code=CLIENT_GONE)
    except EngineError as e:
        run.finish()
        raise ApiError(500, f"generation failed: {e}", "server_error") from None
    except BaseException:
        run.finish()
        raise
    message: ReplyMessage = {"role": "assistant", "content": run.content}
    if run.tool_calls:
        message["tool_calls"] = run.tool_calls
    body = {
        "id": p.call_id, "object": "chat.completion", "created": int(p.arrived),
        "model": p.req.model, "system_fingerprint": p.adapter or "base",
        "choices": [{"index": 0, "message": message, "logprobs": run.logprobs_content(), "finish_reason": run.finish_reason}],
        "usage": run.usage(),
    }
    return _ReplyThen(body, _headers(p), then=run.finish)


async def _sse(state: AppState, run: _Run) -> AsyncIterator[bytes]:
    p = run.p
    base = {"id": p.call_id, "object": "chat.completion.chunk", "created": int(p.arrived),
            "model": p.req.model, "system_fingerprint": p.adapter or "base"}
    include_usage = bool(p.req.stream_options and p.req.stream_options.include_usage)

    def chunk(delta: Mapping[str, object], finish: str | None = None, logprobs: ChoiceLogprobs | None = None) -> bytes:
        body = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            body["usage"] = None
        return b"data: " + json.dumps(body, ensure_ascii=False).encode() + b"\n\n"

    # A text chunk is the same bytes around the JSON string of its text: built once per request,
    # so a token costs one json.dumps of a short string instead of a whole chunk's.
    head, tail = chunk({"content": "\0"}).rsplit(b'"\\u0000"', 1)

    # The role chunk goes out with the first text, and the closing chunks in one write: the engine
    # starts before it is sent, and the client wakes once for each instead of once per chunk.
    opening = chunk({"role": "assistant", "content": ""})
    try:
        try:
            async for text in run.deltas():
                yield opening + head + json.dumps(text, ensure_ascii=False).encode() + tail
                opening = b""
        except EngineError as e:
            err = {"error": {"message": f"generation failed: {e}", "type": "server_error", "param": None, "code": None}}
            yield opening + b"data: " + json.dumps(err).encode() + b"\n\n"
            return
        closing = [opening, *(chunk({"tool_calls": [{"index": i, **call}]}) for i, call in enumerate(run.tool_calls))]
        await run.before_reply()
        closing.append(chunk({}, run.finish_reason, run.logprobs_content()))  # all of them, once the tokens are final
        if include_usage:
            closing.append(b"data: " + json.dumps({**base, "choices": [], "usage": run.usage()}).encode() + b"\n\n")
        yield b"".join(closing) + b"data: [DONE]\n\n"
    finally:
        run.finish()
