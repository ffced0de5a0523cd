"""OpenAI chat requests: validation and rendering to exact prompt ids (replies.py reads replies back).

Rendering happens once per request; the ids it produces are what the engine sees and what the
store keeps. Models whose chat template knows no tools (SmolLM2's does not) get the tools and
earlier tool calls written in the Hermes `<tool_call>` convention that Qwen-family templates use,
so one parser reads tool calls back from every model.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .engine import Constraint
from .records import JsonObject
from .replies import TOOL_CLOSE, TOOL_OPEN

ROLES = ("system", "developer", "user", "assistant", "tool")


# ---------------------------------------------------------------- request schema


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type not in ("text", "input_text", "refusal"):
            raise ValueError(f"content part type {self.type!r} is not supported: this model reads text only")
        if (self.text if self.type != "refusal" else self.refusal) is None:
            raise ValueError(f"content part of type {self.type!r} has no text")
        return self


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str | JsonObject = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # e.g. reasoning_content, cache hints: kept, not rendered
    role: str = Field(json_schema_extra={"enum": list(ROLES)})  # checked by _known_role, with a clear message
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(ROLES)}")
        return v

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.role != "assistant" and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text if p.type != "refusal" else p.refusal for p in self.content)  # type: ignore[misc]


NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError(f"invalid function name {v!r}: use 1-64 of a-z, A-Z, 0-9, _ . -")
        return v

    @field_validator("parameters")
    @classmethod
    def _schema(cls, v: JsonObject | None) -> JsonObject | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("function parameters must be a JSON Schema of type 'object'")
        if v is not None and "properties" in v and not isinstance(v["properties"], dict):
            raise ValueError("function parameters.properties must be an object")
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: dict[str, str]

    @field_validator("function")
    @classmethod
    def _has_name(cls, v: dict[str, str]) -> dict[str, str]:
        if "name" not in v:
            raise ValueError("tool_choice.function needs a name")
        return v


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = "response"
    schema_: JsonObject = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs json_schema")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class ChatRequest(BaseModel):
    # Strict: a boolean is JSON true/false and a number a JSON number ("yes", 1, "0.5" are refused).
    # Unknown fields are kept here (stored requests are read back with this model) and refused at
    # the API (api._prepare): what a client asks for is enforced or refused, never ignored.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # what every engine's generator takes
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)  # only 1 is served (see api._prepare)
    logprobs: bool = False  # the sampled tokens' temperature-1 logprobs (what training uses)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    # OpenAI fields that ask nothing of the reply: accepted and stored with the request.
    user: str | None = Field(None, max_length=256)
    store: bool | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    prompt_cache_key: str | None = Field(None, max_length=256)
    prompt_cache_retention: str | None = Field(None, max_length=32)
    safety_identifier: str | None = Field(None, max_length=256)
    # OpenAI sampling controls this server does not implement: accepted only at the value that
    # asks for nothing (see _not_implemented).
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=300)
    parallel_tool_calls: bool | None = None
    # clawback metadata, also accepted as headers; stripped before rendering
    session_id: str | None = Field(None, max_length=256)
    turn_type: str | None = Field(None, max_length=16)
    turn_id: str | None = Field(None, max_length=256)
    request_id: str | None = Field(None, max_length=256)
    session_done: bool | None = None
    # The preference notes the daemon appended to the messages (daemon/memory.py), kept with the
    # stored request so they can be taken out again; a client's own value is dropped.
    memory_notes: list[str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v and any(len(k) > 64 or len(x) > 512 for k, x in v.items()):
            raise ValueError("metadata keys are at most 64 characters and values at most 512")
        return v

    def not_implemented(self) -> str | None:
        """The first field that asks for something this server does not do (a penalty, a logit
        bias, no parallel tool calls), or None."""
        asks = {"presence_penalty": self.presence_penalty not in (None, 0),
                "frequency_penalty": self.frequency_penalty not in (None, 0),
                "logit_bias": bool(self.logit_bias), "parallel_tool_calls": self.parallel_tool_calls is False}
        return next((name for name, asked in asks.items() if asked), None)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    @model_validator(mode="after")
    def _tools(self) -> ChatRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tool names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function["name"] not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function['name']!r}, which is not in tools")
        if self.tool_choice in ("required",) and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

    def constraint(self) -> Constraint | None:
        """What the reply must match: a forced tool call (tool_choice 'required' or a named
        function) wins over `response_format`; None when the reply is free text."""
        forced = self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)
        if self.tools and forced:
            named = self.tool_choice.function["name"] if isinstance(self.tool_choice, NamedToolChoice) else None
            calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                        "arguments": t.function.parameters or {"type": "object"}},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for t in self.tools if named in (None, t.function.name)]
            schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
            return Constraint(json.dumps(schema), prefix=TOOL_OPEN + "\n", suffix="\n" + TOOL_CLOSE)
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" and fmt.json_schema else {}
        return Constraint(json.dumps(schema or {"type": "object"}))

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def tool_names(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools or ()) if self.tools_enabled() else frozenset()

    def openai_body(self) -> JsonObject:
        """The request as stored: everything the client sent except clawback's own metadata."""
        return self.model_dump(
            exclude={"session_id", "turn_type", "turn_id", "request_id", "session_done"},
            exclude_none=True, by_alias=True,
        )


# ---------------------------------------------------------------- rendering


def _arguments_obj(arguments: str | JsonObject) -> object:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments  # rendered as the raw string the model produced


def _tool_call_text(call: ToolCall) -> str:
    payload = {"name": call.function.name, "arguments": _arguments_obj(call.function.arguments)}
    return f"{TOOL_OPEN}\n{json.dumps(payload, ensure_ascii=False)}\n{TOOL_CLOSE}"


def _tools_instruction(req: ChatRequest) -> str:
    specs = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in req.tools or [])
    text = (
        "You may call functions to help with the user's request. The available functions are:\n"
        f"<tools>\n{specs}\n</tools>\n"
        "To call a function, reply with one block per call:\n"
        f'{TOOL_OPEN}\n{{"name": <function-name>, "arguments": <arguments-object>}}\n{TOOL_CLOSE}'
    )
    if req.tool_choice == "required":
        text += "\nYou must call at least one function."
    elif isinstance(req.tool_choice, NamedToolChoice):
        text += f"\nYou must call the function {req.tool_choice.function['name']}."
    return text


class ChatRenderer:
    """Renders requests through the model's own chat template."""

    def __init__(self, tokenizer: Any) -> None:  # transformers' tokenizer; its stubs type each call's result as a union of every call shape
        self.tokenizer = tokenizer
        template = tokenizer.chat_template or ""
        if not template:
            raise ValueError("the model's tokenizer has no chat template")
        self.native_tools = "tools" in template
        self.native_tool_calls = "tool_calls" in template

    def render(self, req: ChatRequest) -> tuple[str, list[int]]:
        tools_on = req.tools_enabled()
        messages: list[JsonObject] = []
        for m in req.messages:
            role = "system" if m.role == "developer" else m.role
            msg: JsonObject = {"role": role, "content": m.text()}
            if m.tool_calls:
                if self.native_tool_calls:
                    msg["tool_calls"] = [
                        {"type": "function", "id": c.id, "function": {"name": c.function.name, "arguments": _arguments_obj(c.function.arguments)}}
                        for c in m.tool_calls
                    ]
                else:
                    blocks = "\n".join(_tool_call_text(c) for c in m.tool_calls)
                    msg["content"] = f"{msg['content']}\n{blocks}" if msg["content"] else blocks
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None and role == "tool":
                msg["name"] = m.name
            messages.append(msg)
        native_tools = tools_on and self.native_tools
        if tools_on and not native_tools:
            instruction = _tools_instruction(req)
            if messages[0]["role"] == "system":
                messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{instruction}"}
            else:
                messages.insert(0, {"role": "system", "content": instruction})
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False,
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []] if native_tools else None)
        assert isinstance(text, str)  # tokenize=False: the rendered text
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return text, list(ids)


# ---------------------------------------------------------------- reading replies back



def append_text(messages: list[JsonObject], role: str, text: str) -> list[JsonObject]:
    """A copy of `messages` with `text` appended to the last message of `role` (a new one, placed
    first for a system message and last for a user message, if there is none)."""
    out = copy.deepcopy(messages)
    for m in reversed(out):
        if m.get("role") == role:
            if isinstance(m.get("content"), list):
                m["content"].append({"type": "text", "text": text})
            else:
                m["content"] = ((m.get("content") or "") + "\n\n" + text).lstrip("\n")
            return out
    return [{"role": role, "content": text}, *out] if role == "system" else [*out, {"role": role, "content": text}]
