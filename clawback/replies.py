"""Reading a model's reply back: tokens to text as they stream, stop strings and tool-call markup
held back from the client, and the text split into content and OpenAI `tool_calls`."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection
from typing import Any, Literal, TypedDict

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
# How a reply that is only tool calls written without the tags begins, and what may wrap each call.
BARE_CALL_OPENERS = ("{", "```json", "```\n{", "<json>")
_CALL_WRAPPING = re.compile(r"(?:\s|```(?:json)?|</?json>)*")


class FunctionCall(TypedDict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(TypedDict):
    """One entry of an OpenAI reply's `tool_calls`."""
    id: str
    type: Literal["function"]
    function: FunctionCall


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str, tool_names: Collection[str] = ()) -> tuple[str | None, list[ToolCall]]:
    """Split a reply into content and OpenAI `tool_calls`.

    Blocks that are not valid JSON with a string `name` stay in the content, so nothing the model
    wrote is lost. A final block cut off before `</tool_call>` (end token or max_tokens) is still
    read if its JSON is complete. Without any block, a reply that is nothing but JSON objects,
    each bare, in a ``` or ```json fence or in `<json>` tags, calls the tools of `tool_names` that
    those objects call with an object of arguments; the other objects (an imagined tool result,
    say) stay as the content. Small models (such as Qwen2.5-Coder-0.5B) often call tools that way,
    ignoring the tags their template asks for. When tools were offered and no object calls one of
    them, objects that are only a name and an object of arguments are calls too, as a tagged call
    of any name is: the agent answers a tool it does not have with an error the model can read
    and retry from ("Tool count_logs not found"), where as text the reply would end the turn.
    """
    start = text.find(TOOL_OPEN)
    if start < 0:
        return _bare_calls(text, tool_names) or (text, [])
    content_parts = [text[:start]]
    calls: list[ToolCall] = []
    pos = start
    while pos >= 0:
        body_start = pos + len(TOOL_OPEN)
        end = text.find(TOOL_CLOSE, body_start)
        body = text[body_start : end if end >= 0 else len(text)]
        after = end + len(TOOL_CLOSE) if end >= 0 else len(text)
        call = _parse_call(body)
        if call is None:
            content_parts.append(text[pos:after])
        else:
            calls.append(call)
        nxt = text.find(TOOL_OPEN, after)
        content_parts.append(text[after : nxt if nxt >= 0 else len(text)])
        pos = nxt
    content = "".join(content_parts).strip()
    return (content or None), calls


def _bare_calls(text: str, tool_names: Collection[str]) -> tuple[str | None, list[ToolCall]] | None:
    """The content and the calls of a reply made only of JSON objects and their wrapping, when at
    least one object calls an offered tool, or else is only a call; None otherwise."""
    if not tool_names:
        return None
    decoder, objects, pos = json.JSONDecoder(), [], 0
    while (pos := _after_wrapping(text, pos)) < len(text):
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        objects.append((text[pos:end], obj, _call_of(obj)))
        pos = end
    calls = [c for _, _, c in objects if c and c["function"]["name"] in tool_names and c["function"]["arguments"].startswith("{")]
    if not calls:
        calls = [c for _, obj, c in objects if c and _only_a_call(obj)]
    if not calls:
        return None
    rest = [raw for raw, _, c in objects if c not in calls]
    return "\n".join(rest) or None, calls


def _only_a_call(obj: dict[str, object]) -> bool:
    """A name and an object of arguments, and nothing else."""
    return set(obj) in ({"name", "arguments"}, {"name", "parameters"}) and isinstance(
        obj.get("arguments", obj.get("parameters")), dict)


def _after_wrapping(text: str, pos: int) -> int:
    m = _CALL_WRAPPING.match(text, pos)
    return m.end() if m else pos


def _parse_call(body: str) -> ToolCall | None:
    try:
        return _call_of(json.loads(body.strip()))
    except json.JSONDecodeError:
        return None


def _call_of(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {"id": new_tool_call_id(), "type": "function", "function": {"name": obj["name"], "arguments": arguments}}


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting UTF-8 characters."""

    def __init__(self, tokenizer: Any) -> None:  # transformers' tokenizer: only decode and its Rust backend are used
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already emitted (context for the next piece)
        self.read = 0
        # Two decodes per token: the Rust tokenizer's own decode is what `tokenizer.decode` calls,
        # without the Python around it (a third of the cost), unless the tokenizer cleans up spaces.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            self._decode = lambda ids: backend.decode(ids, skip_special_tokens=True)
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self._decode
        prefix_text = decode(self.ids[self.prefix : self.read])
        full_text = decode(self.ids[self.prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return full_text[len(prefix_text) :]
        return ""


class TextGate:
    """Decides which generated text may be streamed now.

    Holds back any tail that could still turn into a stop sequence or the start of a tool call,
    stops at a stop sequence (which is not part of the output), and diverts everything from the
    first `<tool_call>` on into `tool_text` instead of the streamed content. With tools, a reply
    that opens like a call without the tags (`BARE_CALL_OPENERS`) is diverted whole: whether it is a
    call is known at its end (`parse_tool_calls`), and if not, the caller sends it then.
    """

    def __init__(self, stops: list[str], tools: bool) -> None:
        self.stops = stops
        self.watch = stops + ([TOOL_OPEN] if tools else [])
        self.tools = tools
        self.pending = ""
        self.content = ""  # streamed content so far
        self.tool_text = ""  # from the first <tool_call> on
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add generated text; return the content that can be streamed now."""
        if self.stopped:
            return ""
        self.pending += delta
        for stop in self.stops:
            idx = self.pending.find(stop)
            if idx >= 0:
                self.pending = self.pending[:idx]
                self.stopped = True
        if self.tools and not self.content and not self.tool_text:
            head = self.pending.lstrip()
            if head.startswith(BARE_CALL_OPENERS):
                self.tool_text, self.pending = self.pending, ""
                return ""
            if any(opener.startswith(head) for opener in BARE_CALL_OPENERS) and not self.stopped:
                return ""  # may still open one
        if self.tool_text or (self.tools and TOOL_OPEN in self.pending):
            idx = 0 if self.tool_text else self.pending.find(TOOL_OPEN)
            out = self._release(idx)
            self.tool_text += self.pending
            self.pending = ""
            return out
        if self.stopped:
            return self._release(len(self.pending))
        return self._release(len(self.pending) - self._held_tail())

    def finish(self) -> str:
        """The generation ended: release what was held back."""
        return self.feed("") + self._release(len(self.pending))

    @property
    def text(self) -> str:
        return self.content + self.tool_text

    def _release(self, n: int) -> str:
        out, self.pending = self.pending[:n], self.pending[n:]
        self.content += out
        return out

    def _held_tail(self) -> int:
        held = 0
        for w in self.watch:
            for k in range(min(len(w) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(w[:k]):
                    held = max(held, k)
                    break
        return held


_FENCED = re.compile(r"```.*?(?:```|$)", re.DOTALL)
_SENTENCE_END = re.compile(r"[!?\n]+|\.(?!\d)")  # "2.50" is one number
_WORD = re.compile(r"[A-Za-z0-9']+")


def repeats_a_sentence(text: str) -> bool:
    """Says one sentence (or line) twice, word for word: a stutter or a loop, not an answer ("Great
    question! Great question! The gardener…"). A list's item number ("1." in two lists) is no
    sentence, and code inside ``` fences is not prose (a program repeats lines on purpose)."""
    seen = set()
    for part in _SENTENCE_END.split(_FENCED.sub("\n", text).lower()):
        key = " ".join(_WORD.findall(part))
        if key in seen:
            return True
        if key and not key.isdigit():
            seen.add(key)
    return False
