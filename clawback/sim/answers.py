"""Whether a reply's answer is right: its final answer against the task's verified one, and every
computation it writes out.

Numbers are read as people write them: "1,200", "1200.0", "$21", "twenty-one", "one hundred and
five". LaTeX is read as the arithmetic it stands for ("12 \\times 7", "\\frac{96}{8}").

A reply's **final answer** is, in order:
1. the number of its last answer label ("Answer: 15", "the answer is 15", "\\boxed{15}", "#### 15");
2. else, in its last sentence that holds a number and is not a question, the number after the last
   "=" or, with none, its first number that is not one of the question's ("So there are 7 groups
   of 4 students." -> 7), or its last number when all are the question's. A sentence that ends on a run of numbers ("Let's count: 1,
   2, 3, ..., 15") is a list, not an answer: the reply then has none.

A reply is **right** when it has a final answer, that answer is the task's, and every computation it
writes out holds. "12 + 5 = 17 apples" for an answer of 15 is wrong twice; "150x1=200" is read
(as 150 × 1) and is wrong; a computation whose result is not a number ("12 + 5 = ?") is not right.
"""

from __future__ import annotations

import re

_SMALL = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2) for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"hundred": 100, "thousand": 1000, "million": 1_000_000}
_NUMBER_WORD = "|".join(sorted([*_SMALL, *_TENS, *_SCALES], key=len, reverse=True))
# Number words joined by spaces, hyphens or "and" ("one hundred and twenty-one").
_WORDS_RUN = re.compile(rf"\b(?:{_NUMBER_WORD})(?:(?:\s+and\s+|[\s-]+)(?:{_NUMBER_WORD}))*\b", re.IGNORECASE)
# Digits: thousands with commas ("1,200", not "1, 2"), decimals ("2.50"), a currency sign before.
_DIGITS = r"\$?\s?\d+(?:,\d{3})*(?:\.\d+)?(?!,\d{3})"
_NUMBER = re.compile(rf"(?<![\d.a-wyzA-WYZ_]){_DIGITS}")  # "150x1" holds two numbers, "9-bit" one


def words_value(text: str) -> int:
    """ "one hundred and twenty-one" -> 121."""
    total = current = 0
    for w in re.findall(r"[a-z]+", text.lower()):
        if w in _SMALL:
            current += _SMALL[w]
        elif w in _TENS:
            current += _TENS[w]
        elif w == "hundred":
            current = max(current, 1) * 100
        elif w in _SCALES:
            total += max(current, 1) * _SCALES[w]
            current = 0
    return total + current


def number_value(text: str) -> float:
    """A number as written: digits ("$1,200.50") or words ("twenty-one")."""
    digits = text.replace("$", "").replace(",", "").strip()
    return float(digits) if re.fullmatch(r"\d+(?:\.\d+)?", digits) else float(words_value(text))


def _latex_to_text(text: str) -> str:
    """LaTeX arithmetic as plain text: operators, fractions, text wrappers, math delimiters; a
    boxed result as an answer label."""
    for _ in range(3):  # nested fractions
        text = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1) / (\2)", text)
    text = re.sub(r"\\boxed\s*\{([^{}]*)\}", r" Answer: \1 ", text)
    text = re.sub(r"\\(?:times|cdot)", " × ", text)
    text = re.sub(r"\\div", " ÷ ", text)
    text = re.sub(r"\\(?:text|mathrm|mbox)\s*\{([^{}]*)\}", r" \1 ", text)
    text = re.sub(r"\\[\[\]()]|\$\$", " ", text)
    return text.replace("−", "-").replace("–", "-").replace("\\,", "").replace("\\", " ")


def numbers_in(text: str) -> list[tuple[int, int, float]]:
    """(start, end, value) of every number written in the text, digits or words, in order."""
    spans = [(m.start(), m.end(), number_value(m.group())) for m in _NUMBER.finditer(text)]
    spans += [(m.start(), m.end(), float(words_value(m.group()))) for m in _WORDS_RUN.finditer(text)]
    return sorted(spans)


# ---------------------------------------------------------------- written computations

# "150x1" and "3 x 16" multiply; "x" inside a word ("box", "6x") does not, nor "/" in "pages/day".
_OP = re.compile(r"[-+*×÷()]|(?<![A-Za-z])/|/(?![A-Za-z])|(?<=[\d\s])x(?=\s*[\d$(])|\b(?:plus|minus|times|divided by|multiplied by)\b",
                 re.IGNORECASE)
_OPS = {"+": "+", "-": "-", "*": "*", "x": "*", "×": "*", "/": "/", "÷": "/", "plus": "+", "minus": "-",
        "times": "*", "divided by": "/", "multiplied by": "*"}


def _tokens(left: str) -> list[str | float]:
    """The numbers, operators and parentheses of a computation's left side; words are skipped."""
    found = [(s, e, v) for s, e, v in numbers_in(left)]
    found += [(m.start(), m.end(), _OPS.get(m.group().lower(), m.group())) for m in _OP.finditer(left)
              if not any(s <= m.start() < e for s, e, _ in found)]
    return [v for _, _, v in sorted(found, key=lambda t: t[0])]


class _Parser:
    """expr := term (("+"|"-") term)*; term := factor (("*"|"/") factor)*; factor := "-" factor |
    number | "(" expr ")". Raises ValueError on anything else."""

    def __init__(self, tokens: list[str | float]) -> None:
        self.tokens, self.at = tokens, 0

    def peek(self) -> str | float | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def take(self) -> str | float | None:
        self.at += 1
        return self.tokens[self.at - 1] if self.at <= len(self.tokens) else None

    def expr(self) -> float:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> float:
        value = self.factor()
        while self.peek() in ("*", "/"):
            if self.take() == "*":
                value *= self.factor()
            else:
                value /= self.factor()  # ZeroDivisionError: the caller's "wrong"
        return value

    def factor(self) -> float:
        t = self.take()
        if t == "-":
            return -self.factor()
        if t == "(":
            value = self.expr()
            if self.take() != ")":
                raise ValueError("unclosed parenthesis")
            return value
        if isinstance(t, float):
            return t
        raise ValueError(f"unexpected {t!r}")


def _evaluate(tokens: list[str | float]) -> float | None:
    """The value of the longest run of tokens that ends the list and parses as arithmetic with at
    least one operator ("Mia has 12 - 5 + 8" -> 15); None when there is none."""
    for start in range(len(tokens)):
        run = tokens[start:]
        if not any(t in ("+", "-", "*", "/") for t in run):
            return None
        parser = _Parser(run)
        try:
            value = parser.expr()
        except ValueError:
            continue
        if parser.at == len(run):
            return value
    return None


_EQUALS = re.compile(r"=")
# A list item's marker at the start of a line ("   - 850 km/h × 3 hours = 2550 km") is not a minus.
_BULLET = re.compile(r"^\s*[-*+•]\s+")


def computations(text: str) -> list[bool]:
    """Whether each computation the reply writes out is right: before every "=", the longest run of
    numbers, operators and parentheses that ends there ("3 x 16 - 9 = 39", "25 minutes * 12 days =
    300": words between are skipped), with the usual precedence; after it, the number it claims,
    rounded to the places written. A chain "5 x 4 = 20 x 2 = 40" holds two. A claimed result that
    is not a number ("12 + 5 = ?") is wrong; an "=" with no operator before it computes nothing. A
    line's list marker ("- 850 × 3 = 2550") is not a minus sign."""
    text = _latex_to_text(text)
    out = []
    for eq in _EQUALS.finditer(text):
        start = max(text.rfind("\n", 0, eq.start()), text.rfind("=", 0, eq.start()), 0)
        left = text[start:eq.start()]
        if text[start:start + 1] != "=":
            left = _BULLET.sub("", left)
        try:
            value = _evaluate(_tokens(left))
        except ZeroDivisionError:
            out.append(False)
            continue
        if value is None:
            continue
        stop = min((i for i in (text.find("\n", eq.end()), text.find("=", eq.end())) if i >= 0), default=len(text))
        # A result that is not a number ("12 + 5 = ?") cannot be checked: not right. "10 / 3 = 3.33" is.
        out.append(any(abs(value - claimed) <= 0.5 * 10 ** -places + 1e-9
                       for claimed, places in _claimed(text[eq.end():stop])))
    return out


def _claimed(right: str) -> list[tuple[float, int]]:
    """What the right side of an "=" may claim, each with the decimal places it is written to: the
    number right after it, and the arithmetic that starts there, up to the first word or
    punctuation, as in a chain of equal values ("3 x 16 - 9 = 48 - 9 = 39"; a running one, "5 x 4 =
    20 x 2 = 40", claims its first number). None there: nothing ("= ?")."""
    found = [(s, e, v) for s, e, v in numbers_in(right)]
    found += [(m.start(), m.end(), _OPS.get(m.group().lower(), m.group())) for m in _OP.finditer(right)
              if not any(s <= m.start() < e for s, e, _ in found)]
    run, at = [], 0
    for s, e, v in sorted(found, key=lambda t: t[0]):
        if right[at:s].strip(" \t*$"):
            break
        run.append((v, right[s:e]))
        at = e
    def places(written: list[str]) -> int:
        return max((len(w.split(".")[1]) for w in written if re.search(r"\d\.\d", w)), default=0)

    out = []
    if run and isinstance(run[0][0], float):  # the number right after the "="
        out.append((run[0][0], places([run[0][1]])))
    for n in range(len(run), 1, -1):  # the longest arithmetic that starts there
        parser = _Parser([v for v, _ in run[:n]])
        try:
            value = parser.expr()
        except (ValueError, ZeroDivisionError):
            continue
        if parser.at == n:
            out.append((value, places([w for v, w in run[:n] if isinstance(v, float)])))
            break
    return out


def arithmetic_holds(text: str) -> bool:
    """Every computation the reply writes out is right (a reply with none holds)."""
    return all(computations(text))


# ---------------------------------------------------------------- the final answer

_LABEL = re.compile(r"answer(?:\s+is)?\s*[:=]?\s*\**\s*(?=[$\d]|[a-z])|^\s*#{2,}\s*",
                    re.IGNORECASE | re.MULTILINE)
# A sentence that ends on a run of three or more numbers with only commas or spaces between.
_LIST_END = re.compile(r"\d(?:[\s,;]+(?:and\s+)?\$?\d+(?:\.\d+)?){2,}\W*$")
_SENTENCE_END = re.compile(r"[!?\n]|\.(?!\d)")


def _first_number_at(text: str, at: int) -> float | None:
    """The number that starts right at `at` (after spaces, "$" or "**")."""
    found = numbers_in(text[at:at + 60])
    return found[0][2] if found and not text[at:at + found[0][0]].strip(" \t*$") else None


def final_answer(reply: str, question: str = "") -> float | None:
    """The reply's final answer (module docstring), or None when it states none."""
    text = _latex_to_text(reply)
    labelled = [v for m in _LABEL.finditer(text) if (v := _first_number_at(text, m.end())) is not None]
    if labelled:
        return labelled[-1]
    ends = [m.end() for m in _SENTENCE_END.finditer(text)]
    sentences = [(text[a:b], text[b - 1:b]) for a, b in zip([0, *ends], [*ends, len(text)])]
    for sentence, end in reversed(sentences):
        found = numbers_in(sentence)
        if not found or end == "?":
            continue
        if _LIST_END.search(sentence):
            return None  # "1, 2, 3, ... 15": a list, not an answer
        last_eq = sentence.rfind("=")
        if last_eq >= 0 and (after := [v for s, _, v in found if s > last_eq]):
            return after[0]
        given = {v for _, _, v in numbers_in(question)}
        new = [v for _, _, v in found if v not in given]
        return new[0] if new else found[-1][2]
    return None


def answer_right(reply: str, answer: str, question: str = "") -> bool:
    """The reply states a final answer, it is `answer`, and every computation it writes holds."""
    said = final_answer(reply, question)
    return said is not None and abs(said - number_value(answer)) < 1e-6 and arithmetic_holds(reply)
