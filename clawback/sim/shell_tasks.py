"""The shell scenario's tasks: files made in a fresh directory, a request, and a checker.

Seven families: count the lines of a file, count the files of one kind, find the file that holds a
word, rename files by a pattern, extract a field from a CSV, extract a field from a JSON file, fix a
script that fails. Every task is generated from its family and an index (the same index, the same
files), with its verified answer. The held-out tasks are other instances of the same families
(other names, words and numbers), never sent during training.

A task is **solved** by what the commands did, never by what the reply says:
- an *answer* task: the last command ran, exited 0 and printed one non-empty line whose first
  word is the answer (`wc -l notes.txt` prints "37 notes.txt"; a leading "./" on a path is allowed);
- a *state* task: the directory holds exactly the expected regular files with their contents;
- a *script* task: the script, run again in the sandbox on new data the policy never saw, prints
  the right result (a script that prints a hard-coded number fails).

The checker reads the directory without following symbolic links, so a link the policy made to a
file outside the directory is never read.

Each task also carries one command that solves it and one plausible one that does not: the tests
run both through the sandbox and the checker.
"""

from __future__ import annotations

import os
import random
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .sandbox import ExecResult, Sandbox

SHELL = "shell"  # the scenario's name
WORDS = ("apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "piano", "ocean", "candle", "forest",
         "garden", "silver", "rocket", "violet", "bridge", "winter", "coffee", "mirror", "planet", "castle",
         "harbor", "meadow", "pepper", "saddle", "thunder", "velvet", "walnut", "yellow", "zipper")
NAMES = ("Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena", "Milo", "Nora",
         "Otto", "Pia", "Quinn", "Rosa", "Sami", "Tess")
CITIES = ("Oslo", "Lyon", "Porto", "Graz", "Turin", "Ghent", "Malmo", "Bergen", "Delft", "Cork", "Brno", "Split")


@dataclass(frozen=True)
class Verdict:
    solved: bool
    why: str  # what the checker saw, in words a test runner would use (it becomes the outcome's text)


@dataclass(frozen=True)
class ShellTask:
    family: str
    index: int
    prompt: str
    files: tuple[tuple[str, str], ...]  # relative path, content: made in the fresh directory
    answer: str | None = None  # answer tasks: the verified answer
    expected: tuple[tuple[str, str], ...] | None = None  # state tasks: every regular file and its content
    rerun: tuple[tuple[tuple[str, str], ...], str, str] | None = None  # script tasks: new files, command, output
    solution: str = ""  # a command that solves the task
    wrong: str = ""  # a plausible command that does not

    @property
    def key(self) -> str:
        return f"{self.family}-{self.index}"

    def make(self, workdir: Path) -> None:
        for rel, content in self.files:
            path = workdir / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)

    def check(self, workdir: Path, last: ExecResult | None, sandbox: Sandbox) -> Verdict:
        if self.answer is not None:
            return _check_answer(self.answer, last)
        if self.expected is not None:
            return _check_state(workdir, dict(self.expected))
        assert self.rerun is not None
        files, command, output = self.rerun
        for rel, content in files:
            path = workdir / rel
            if path.is_symlink() or (path.exists() and not path.is_file()):
                return Verdict(False, f"{rel} is not a regular file")
            path.unlink(missing_ok=True)
            path.write_text(content)
        result = sandbox.run(command, workdir)
        if result.ok and result.output.strip() == output:
            return Verdict(True, f"`{command}` printed {output} on new data")
        return Verdict(False, f"`{command}` on new data: expected {output}, got: {result.text()[-300:]}")


def _check_answer(answer: str, last: ExecResult | None) -> Verdict:
    if last is None:
        return Verdict(False, "no command was run")
    if not last.ok:
        return Verdict(False, f"the last command failed: {last.text()[-300:]}")
    lines = [line for line in last.output.splitlines() if line.strip()]
    if len(lines) != 1:
        return Verdict(False, f"the last command printed {len(lines)} lines, not one answer")
    first = lines[0].split()[0].removeprefix("./")
    if first == answer:
        return Verdict(True, f"the last command printed the right answer {answer}")
    return Verdict(False, f"the last command printed {lines[0].strip()[:80]!r}, which is not the answer")


def regular_files(workdir: Path) -> dict[str, str | None]:
    """Every entry under the directory, by relative path: the content of a regular file, None for
    anything else (a symbolic link is never followed, a directory is walked)."""
    out: dict[str, str | None] = {}
    for root, dirs, files in os.walk(workdir, followlinks=False):
        for name in files + [d for d in dirs if (Path(root) / d).is_symlink()]:
            path = Path(root) / name
            rel = os.path.relpath(path, workdir)
            if stat.S_ISREG(os.lstat(path).st_mode):
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd, "rb") as f:
                    out[rel] = f.read(1 << 20).decode("utf-8", "replace")
            else:
                out[rel] = None
    return out


def _check_state(workdir: Path, expected: dict[str, str]) -> Verdict:
    have = regular_files(workdir)
    missing = sorted(set(expected) - set(have))
    extra = sorted(set(have) - set(expected))
    changed = sorted(k for k in expected if k in have and have[k] != expected[k])
    if not (missing or extra or changed):
        return Verdict(True, "the directory holds exactly the expected files")
    parts = [f"{label}: {', '.join(names[:5])}" for label, names in
             (("missing", missing), ("unexpected", extra), ("wrong content", changed)) if names]
    return Verdict(False, "; ".join(parts))


# ---------------------------------------------------------------- families


def _lines(rng: random.Random, n: int) -> str:
    return "".join(" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5))) + "\n" for _ in range(n))


def count_lines(rng: random.Random, i: int) -> ShellTask:
    name, n = f"{rng.choice(WORDS)}_{i}.txt", rng.randint(12, 60)
    return ShellTask("count_lines", i, f"How many lines does the file {name} have? Run a command that prints "
                     "only the number.", ((name, _lines(rng, n)),), answer=str(n),
                     solution=f"wc -l < {name}", wrong=f"wc -w < {name}")


def count_files(rng: random.Random, i: int) -> ShellTask:
    ext, other = rng.sample(("log", "csv", "md", "txt", "dat"), 2)
    n, m = rng.randint(3, 9), rng.randint(2, 6)
    files = tuple((f"data/{rng.choice(WORDS)}_{k}.{ext}", "x\n") for k in range(n)) + \
        tuple((f"data/{rng.choice(WORDS)}_{k}.{other}", "y\n") for k in range(m))
    return ShellTask("count_files", i, f"How many .{ext} files are in the data directory? Run a command that "
                     "prints only the number.", files, answer=str(n),
                     solution=f"ls data/*.{ext} | wc -l", wrong="ls data | wc -l")


def find_by_content(rng: random.Random, i: int) -> ShellTask:
    word = f"{rng.choice(WORDS)}{rng.randint(100, 999)}"
    names = sorted(rng.sample(WORDS, 5))
    target = names[rng.randint(1, 4)]  # never the first listed: `ls | head -1` is not a solution
    files = tuple((f"notes/{n}.txt", _lines(rng, 6) + (f"see {word} here\n" if n == target else "")) for n in names)
    return ShellTask("find_by_content", i, f"Which file in the notes directory contains the word {word}? Run a "
                     "command that prints only its path.", files, answer=f"notes/{target}.txt",
                     solution=f"grep -rl {word} notes", wrong="ls notes/* | head -1")


def rename_by_pattern(rng: random.Random, i: int) -> ShellTask:
    old, new = rng.choice((("jpeg", "jpg"), ("htm", "html"), ("text", "txt"), ("yml", "yaml")))
    stems = rng.sample(WORDS, rng.randint(3, 5))
    keep = f"{rng.choice(WORDS)}_notes.md"
    files = tuple((f"{s}.{old}", f"{s} {i}\n") for s in stems) + ((keep, "keep me\n"),)
    expected = tuple((f"{s}.{new}", f"{s} {i}\n") for s in stems) + ((keep, "keep me\n"),)
    return ShellTask("rename_by_pattern", i, f"Rename every .{old} file in this directory so that it ends in "
                     f".{new} instead, keeping the rest of its name. Leave other files alone.", files,
                     expected=expected,
                     solution=f'for f in *.{old}; do mv "$f" "${{f%.{old}}}.{new}"; done', wrong=f"rm *.{old}")


def extract_csv(rng: random.Random, i: int) -> ShellTask:
    people = rng.sample(NAMES, 6)
    cities = rng.sample(CITIES, len(people))  # distinct: another row's city is never the answer
    who = rng.randint(1, 5)  # never the first row: reading the first data line is not a solution
    rows = "".join(f"{k + 1},{p},{c},{rng.randint(20, 70)}\n" for k, (p, c) in enumerate(zip(people, cities)))
    return ShellTask("extract_csv", i, f"In people.csv, which city does {people[who]} live in? Run a command "
                     "that prints only the city.", (("people.csv", "id,name,city,age\n" + rows),),
                     answer=cities[who], solution=f"awk -F, '$2==\"{people[who]}\" {{print $3}}' people.csv",
                     wrong="sed -n 2p people.csv | cut -d, -f3")


def extract_json(rng: random.Random, i: int) -> ShellTask:
    port = rng.randint(1025, 9999)
    host = f"{rng.choice(WORDS)}.internal"
    body = (f'{{\n  "name": "{rng.choice(WORDS)}",\n  "version": {rng.randint(2, 9)},\n  "retries": {rng.randint(3, 7)},\n'
            f'  "server": {{\n    "host": "{host}",\n    "port": {port}\n  }}\n}}\n')
    return ShellTask("extract_json", i, "What port does config.json set for the server? Run a command that "
                     "prints only the number.", (("config.json", body),), answer=str(port),
                     solution="python3 -c \"import json; print(json.load(open('config.json'))['server']['port'])\"",
                     wrong="grep -o '[0-9][0-9]*' config.json | head -1")


# A script that fails, and the sed edit that fixes it (the tests' solution command).
_BROKEN_SCRIPTS = (
    ("print(sum(int(x) for x in open('numbers.txt').read().split(',')))\n", "s/split(',')/split()/"),
    ("total = 0\nfor line in open('numbers.txt'):\n    total += line\nprint(total)\n", "s/+= line/+= int(line)/"),
    ("nums = [int(x) for x in open('numbers.txt')]\nprnt(sum(nums))\n", "s/prnt(/print(/"),
    ("nums = [int(x) for x in open('number.txt')]\nprint(sum(nums))\n", "s/number.txt/numbers.txt/"),
    ("nums = open('numbers.txt').read().split()\nprint(sum(nums))\n", "s/sum(nums)/sum(map(int, nums))/"),
    ("with open('numbers.txt') as f:\nprint(sum(int(x) for x in f))\n", "s/^print/    print/"),
)


def fix_script(rng: random.Random, i: int) -> ShellTask:
    broken, edit = _BROKEN_SCRIPTS[i % len(_BROKEN_SCRIPTS)]
    numbers = [rng.randint(1, 99) for _ in range(rng.randint(4, 8))]
    fresh = [rng.randint(100, 999) for _ in range(5)]
    return ShellTask("fix_script", i, "total.py should print the sum of the numbers in numbers.txt (one per "
                     "line), but it fails. Fix total.py so that `python3 total.py` prints the sum.",
                     (("total.py", broken),
                      ("numbers.txt", "".join(f"{n}\n" for n in numbers))),
                     rerun=((("numbers.txt", "".join(f"{n}\n" for n in fresh)),), "python3 total.py", str(sum(fresh))),
                     solution=f"sed -i \"{edit}\" total.py && python3 total.py", wrong="python3 total.py")


FAMILIES: tuple[Callable[[random.Random, int], ShellTask], ...] = (
    count_lines, count_files, find_by_content, rename_by_pattern, extract_csv, extract_json, fix_script)
TRAIN_PER_FAMILY, EVAL_PER_FAMILY = 4, 2


def _tasks(split: str, per_family: int, first: int) -> tuple[ShellTask, ...]:
    return tuple(make(random.Random(f"shell/{split}/{make.__name__}/{k}"), k)
                 for k in range(first, first + per_family) for make in FAMILIES)


# Train and held-out tasks differ in their index (file names, words, numbers, the broken script).
TRAIN = _tasks("train", TRAIN_PER_FAMILY, 0)
EVAL = _tasks("eval", EVAL_PER_FAMILY, TRAIN_PER_FAMILY)
