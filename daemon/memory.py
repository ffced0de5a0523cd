"""Preference notes: what the person asked for in corrections and 👎 reasons, kept short.

A correction is split into sentences; each sentence of two or more words is a note. A note's
topic is its set of content words (negations and filler removed), so "Please use bold." and
"Please don't use bold." share a topic and the newer replaces the older (newest wins on a
conflict), while the same sentence again only refreshes it (de-duplicated). At most
`memory_max_notes` are kept: the least recently confirmed goes first.

When `memory` is on, main calls get the notes appended to their system prompt (`inject`), and the
request is stored as served, so training and the teacher see exactly what the policy saw.
"""

from __future__ import annotations

import re
from typing import Any

from clawback.chat import append_text

MAX_NOTE_CHARS = 300
HEADER = "What this user has told you they want (follow it in every reply):"

_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"[a-z0-9']+")
# Words that do not change what a note is about; negations are here so that a reversed
# preference lands on the same topic as the one it reverses.
_FILLER = frozenset("""a an the and or but so to of in on at for with by from as is are be it its this that these those
please pls i i'd i'm me my you your you're we us our do don't dont does doesn't not no never
can could would should will just also more less really very much too again""".split())


def topic(sentence: str) -> str:
    words = sorted({w for w in _WORD.findall(sentence.lower()) if w not in _FILLER})
    return " ".join(words)


def notes_from(text: str) -> list[str]:
    """The note sentences of a correction or 👎 reason, in order, each at most MAX_NOTE_CHARS."""
    out = []
    for sentence in _SENTENCE.split(text.strip()):
        s = " ".join(sentence.split())[:MAX_NOTE_CHARS]
        if len(_WORD.findall(s.lower())) >= 2 and topic(s):
            out.append(s)
    return out


def inject(messages: list[dict[str, Any]], notes: list[str]) -> list[dict[str, Any]]:
    """The messages with the notes appended to the system prompt (a new one first if none)."""
    if not notes:
        return messages
    return append_text(messages, "system", HEADER + "\n" + "\n".join(f"- {n}" for n in notes))
