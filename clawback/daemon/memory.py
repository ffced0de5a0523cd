"""Preference notes: what the person asked for in corrections and 👎 reasons, kept short.

A correction is split into sentences; a sentence of two or more words that asks for something
(a request: "Please start with 'Sure!'.", "Don't use bold.", "I'd like shorter replies.") is a
note. The rest of a correction (the complaint, "That looks AI-written.", "It was cut off.") says
what went wrong, not what to do, and is skipped with a recorded reason. So is a request about the
exchange rather than about replies ("Just answer, don't talk about my feedback.", "Don't repeat
yourself."): it asks the next reply not to do what went wrong in the last one, which plain notes
already serve, and as a standing line under every message it made a small model loop instead
(bench/README.md, "Notes about the exchange"). A note's
topic is its set of content words (negations and filler removed), so "Please use bold." and
"Please don't use bold." share a topic and the newer replaces the older (newest wins on a
conflict), while the same sentence again only refreshes it (de-duplicated); a note whose topic
covers an older one's and more replaces it too, and one that repeats part of an older one in its
words only refreshes that one (store/notes.py `_put_note`). A note is general (about replies anywhere)
or about the task of the conversation it came from, by its wording (`scope`, below): a session
note is injected only into that conversation's main calls, and topics are compared within one
scope. At most `memory_max_notes` general notes are kept, and as many for each conversation: the
least recently confirmed goes first.

When `memory` is on, main calls get the notes (general, and their conversation's) appended to their last user message (or, with
`memory_placement = "system"`, to their system prompt; `inject`), one per line and in the
person's own words, as if they had written them under their message; the request is stored as
served, with the notes it was given as `memory_notes`, so training and the teacher see exactly
what the policy saw. The user message is the default because a small model follows a request
there far more often than in the system prompt (bench/README.md, "In-context following"), and
the plain lines because under a header ("What this user has told you they want:") it opens by
acknowledging them instead ("Sure! I'll make sure to keep it simple."; "The form of the notes").
The notes go least recently confirmed first, so what the person asked for last sits nearest their
message, where a small model follows it (the same notes in the other order broke 12 of 16 greedy
replies against 4: "The order of the notes").

Training consolidates notes into the weights: after a version goes live, retirement.py checks
each note against it and retires the ones it already follows without being told. With
`memory_consolidate` a reply served with notes trains in its request without them (`strip`;
samples.py `_consolidate`), to teach the weights what the notes made the policy do; it is off by
default (bench/README.md, "Training without the notes").
"""

from __future__ import annotations

import copy
import re

from clawback.chat import append_text
from clawback.records import JsonObject

MAX_NOTE_CHARS = 300

_SENTENCE = re.compile(r"(?<=[.!?])\s+")
_WORD = re.compile(r"[a-z0-9']+")
# Words that do not change what a note is about; negations are here so that a reversed
# preference lands on the same topic as the one it reverses.
_FILLER = frozenset("""a an the and or but so to of in on at for with by from as is are be it its this that these those
please pls i i'd i'm me my you your you're we us our do don't dont does doesn't not no never
can could would should will just also more less really very much too again""".split())


# A request opens with one of these (after "please", "and", "next time", ...) or says so in
# words (_ASKS, _WANTS). A statement about the last reply ("It was cut off.") has neither.
_LEAD = re.compile(r"^(?:(?:and|also|actually|so|but|just|please|pls|kindly|now|instead|next time|from now on|"
                   r"in future|in the future|going forward)[\s,]+)*", re.IGNORECASE)
_IMPERATIVE = frozenset("""add address aim always answer ask avoid be begin call capitalize check cite close cut
don't dont drop end explain focus follow format give go include keep leave let limit list make mention name
never number offer omit open put quote refer remember remove reply respond say show sign skip speak spell
start state stay stick stop summarise summarize switch talk tell try turn use write""".split())
_ASKS = re.compile(r"\b(?:please|you (?:should|must|need to|have to)|should|must|instead)\b", re.IGNORECASE)
_WANTS = re.compile(r"(?:i(?:'d| would) (?:like|prefer|rather)|i (?:want|need|prefer|like it when)|(?:do not|no) \w)",
                    re.IGNORECASE)


def is_request(sentence: str) -> bool:
    """Does the sentence ask for something about replies (not only complain about the last one)?"""
    if _ASKS.search(sentence):
        return True
    rest = _LEAD.sub("", sentence.strip())
    if _WANTS.match(rest):
        return True
    first = _WORD.match(rest.lower())
    return first is not None and first.group(0) in _IMPERATIVE


# A sentence about the exchange itself: the person's feedback, or the last reply's loop.
_ABOUT_EXCHANGE = re.compile(r"\b(?:feedback|corrections?|complaints?|repeat(?:ing)? yourself"
                             r"|what i (?:said|wrote|told you|asked))\b", re.IGNORECASE)


# Scope. A note about replies in general ("Don't use markdown.", "Keep answers short.") is injected
# into every main call; one about the task at hand ("Use pandas for this one.", "The answer is 12,
# not 4.", "Answer with just the number, like: 4.") only into its own conversation's, where a
# standing line would otherwise answer later tasks with this one's number or tool. The wording
# decides, in this order (quoted text is an example of a form and is read as nothing):
# 1. it names its scope: "in this chat" is the conversation's; "always", "from now on", "every
#    reply" are general;
# 2. it points at the task: "this one", "this question", "for this", "here", "for now", "above";
#    a question that is not a polite request ("And a string?", not "Could you keep it short?");
#    a stated answer ("the answer is"); a number that is not a count of some part of a reply
#    ("like: 4", "not 4", but not "under 20 words", "2 decimal places");
# 3. anything else is about replies in general.
# Measured on the simulator's corrections and hand-written cases of both kinds by
# bench/note_scope.py (bench/README.md, "The scope of a note").
_QUOTED = re.compile(r"(?<!\w)'[^']*'(?!\w)|\"[^\"]*\"|`[^`]*`|‘[^’]*’|“[^”]*”")
_SESSION_SAYS = re.compile(r"\b(?:in|for) (?:the rest of )?this (?:chat|conversation|session|thread)\b|\bfor now\b",
                           re.IGNORECASE)
_GENERAL_SAYS = re.compile(r"\b(?:always|from now on|in (?:the )?future|going forward|every (?:time|reply|answer|response)"
                           r"|all (?:your |of your )?(?:replies|answers|responses)|in general|whenever|every chat"
                           r"|every conversation|everywhere)\b", re.IGNORECASE)
_TASK_NOUNS = (r"one|ones|question|task|problem|exercise|case|time|example|sum|equation|calculation|code|script|program"
               r"|function|file|query|bug|answer|result|number|step|part|list|table|data|string|word|sentence|paragraph"
               r"|text|email|letter|essay|story|page|document|request")
_POINTS_AT_TASK = re.compile(rf"\b(?:this|these|that) (?:{_TASK_NOUNS})s?\b|\bfor this\b|\bhere\b(?!'s)|\babove\b"
                             r"|\bthe (?:right |correct |real |actual )?(?:answer|result|total) (?:is|was|should be)\b",
                             re.IGNORECASE)
_POLITE_ASK = re.compile(r"^(?:(?:and|so|but|also|please)[\s,]+)*(?:can|could|would|will) you\b", re.IGNORECASE)
_REPLY_PARTS = (r"words?|sentences?|lines?|paragraphs?|bullets?|bullet points?|points?|characters?|chars|items?|steps?"
                r"|examples?|decimals?|decimal places?|digits?|spaces?|tabs?|emojis?|questions?|tokens?|options?"
                r"|sections?|headers?|headings?|columns?|significant figures?")
_COUNT = re.compile(rf"\b\d+(?:\s*(?:and|or|to|-|–)\s*\d+)?\s+(?:{_REPLY_PARTS})\b", re.IGNORECASE)
_NUMBER = re.compile(r"\d")


def scope(sentence: str) -> str:
    """"session" when the sentence is about the task at hand, "general" when it is about replies
    in general (the rule above)."""
    s = _QUOTED.sub(" ", sentence)
    if _SESSION_SAYS.search(s):
        return "session"
    if _GENERAL_SAYS.search(s):
        return "general"
    question = s.rstrip().endswith("?") and not _POLITE_ASK.match(_LEAD.sub("", s.strip()))
    if question or _POINTS_AT_TASK.search(s) or _NUMBER.search(_COUNT.sub(" ", s)):
        return "session"
    return "general"


def topic(sentence: str) -> str:
    words = sorted({w for w in _WORD.findall(sentence.lower()) if w not in _FILLER})
    return " ".join(words)


_NEGATIONS = frozenset("don't dont not no never".split())


def repeats(narrower: str, wider: str) -> bool:
    """Does `narrower` ask for part of what `wider` asks, in the same words ("Please answer in under
    20 words." in "Please answer in under 20 words and give the number."), rather than reverse it
    ("Please use bold." against "Please don't use bold and keep it short.")?"""
    a = [w for w in _WORD.findall(narrower.lower()) if w not in ("please", "pls")]
    b = [w for w in _WORD.findall(wider.lower()) if w not in ("please", "pls")]
    return bool(a) and any(b[i:i + len(a)] == a and (i == 0 or b[i - 1] not in _NEGATIONS)
                           for i in range(len(b) - len(a) + 1))


def notes_from(text: str) -> tuple[list[str], dict[str, int]]:
    """The note sentences of a correction or 👎 reason, in order, each at most MAX_NOTE_CHARS,
    and how many sentences were skipped, by reason."""
    out, skipped = [], {}
    for sentence in _SENTENCE.split(text.strip()):
        s = " ".join(sentence.split())[:MAX_NOTE_CHARS]
        if len(_WORD.findall(s.lower())) >= 2 and topic(s):
            reason = ("not a request" if not is_request(s) else
                      "about the exchange, not replies" if _ABOUT_EXCHANGE.search(s) else None)
            if reason:
                skipped[reason] = skipped.get(reason, 0) + 1
            else:
                out.append(s)
    return out, skipped


def inject(messages: list[JsonObject], notes: list[str], placement: str = "user") -> list[JsonObject]:
    """The messages with the notes appended, one per line, to the last message of `placement`
    ("user" or "system"; a new system message first if there is none)."""
    if not notes:
        return messages
    return append_text(messages, placement, "\n".join(notes))


def strip(messages: list[JsonObject], notes: list[str] | None) -> list[JsonObject]:
    """The messages without the notes `inject` appended (`notes` as it was given them; a request
    keeps them as `memory_notes`)."""
    return renote(messages, notes, [])


def renote(messages: list[JsonObject], notes: list[str] | None, new: list[str]) -> list[JsonObject]:
    """The messages with the notes `inject` appended (`notes`) replaced by `new`: the block is
    found at the end of the last user message, or else the last system message; with `new` empty
    it is cut, and a message that held nothing else is dropped."""
    out = copy.deepcopy(messages)
    block, new_block = "\n".join(notes or []), "\n".join(new)
    for role in ("user", "system") if block else ():
        at = max((i for i, m in enumerate(out) if m.get("role") == role), default=-1)
        content = out[at].get("content") if at >= 0 else None
        if isinstance(content, list) and content and isinstance(content[-1], dict) and content[-1].get("text") == block:
            out[at]["content"] = content[:-1] + ([{**content[-1], "text": new_block}] if new else [])
        elif isinstance(content, str) and (content == block or content.endswith("\n\n" + block)):
            rest = content.removesuffix(block).removesuffix("\n\n")
            out[at]["content"] = (rest + "\n\n" + new_block).lstrip("\n") if new else rest
        else:
            continue
        return out if out[at]["content"] else out[:at] + out[at + 1:]
    return out
