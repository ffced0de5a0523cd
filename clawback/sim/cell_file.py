"""What a finished cell's file holds (results.py writes and reads it), and the harness's progress.

TypedDicts, not records: a cell file is JSON that results.py, bench/paired_cells.py and people read
back as it was written, years of cells among them. A key marked NotRequired is one that older
cells lack; a cell written now has every key. The first cells (bench/results/simulate) predate
`meets` and `gate` on each interaction and are not summarized.

Evaluated annotations (no `from __future__ import annotations`), so that each TypedDict's
`__required_keys__` knows its NotRequired keys.
"""

from typing import NotRequired, TypedDict


class CellKey(TypedDict):
    scenario: str
    method: str
    seed: int


class CodeStamp(TypedDict):
    """What code ran (stamp.py)."""

    stamp: str
    commit: str | None
    dirty: bool


class CurvePoint(TypedDict):
    """The held-out greedy evaluation at one point of the run: the shares of replies that meet the
    scenario and that are right, with the notes (as served) and without them (`_off`)."""

    interaction: int
    version: int | None
    score: float
    checks: dict[str, float]  # each check's pass rate (shell: each task family's share solved)
    meets: NotRequired[float]
    right: NotRequired[float]
    cut: NotRequired[int]
    meta: NotRequired[int]
    repeat: NotRequired[int]
    meets_off: NotRequired[float]
    right_off: NotRequired[float]
    carried: NotRequired[bool]  # the last point repeated at the end of the run, not evaluated there


class ProbePoint(TypedDict):
    interaction: int
    version: int | None
    mass: float | None  # None: the scenario has no opener rule
    mass_off: NotRequired[float | None]  # the same without the notes (cells recorded since it exists)


class ShellCommand(TypedDict):
    """One command the policy ran in a shell episode (None: its tool call had no command)."""

    command: str | None
    exit_code: int | None
    result: str


class EpisodeRecord(TypedDict):
    """A shell episode: the task, the checker's verdict, what ran and the policy's replies."""

    task: str
    solved: bool
    why: str
    commands: list[ShellCommand]
    replies: list[str]
    cut: int


class Interaction(TypedDict):
    """One session of the run: the policy's reply and the user's reaction to it."""

    i: int
    adapter: int | None  # the live version that replied
    rating: float
    meets: bool
    gate: str | None  # "cut" | "meta" | "repeat" when the reply failed every check at once
    reaction: str
    right: NotRequired[bool]
    reply: NotRequired[str]


class ShellInteraction(Interaction, EpisodeRecord):
    pass


class HeldOutReplies(TypedDict):
    """The held-out greedy replies at one evaluation (shell: its episodes)."""

    interaction: int
    version: int | None
    replies: NotRequired[list[str]]
    replies_off: NotRequired[list[str]]
    episodes: NotRequired[list[EpisodeRecord]]


class EvalReplies(TypedDict, total=False):
    before: HeldOutReplies
    last: HeldOutReplies


class TrainStepRow(TypedDict):
    version: int
    parent: int | None
    samples: int
    outcome: str
    error: str | None
    seconds: float
    metrics: dict[str, float]


class SampleCounts(TypedDict, total=False):
    """Samples by state at the end of the cell, the dropped ones by reason."""

    pending_judge: int
    ready: int
    consumed: int
    dropped: dict[str, int]
    loops: int  # trained against their loop


class Versions(TypedDict):
    promoted: list[int]
    refused: dict[str, str | None]  # version -> why
    gate_seconds: list[float]
    gate: dict[str, dict[str, object]]  # version -> the gate's report (daemon/gate.py), passed through


class MemoryNote(TypedDict):
    note_id: int
    text: str
    created_at: float
    retired_by: int | None
    retired_at: float | None
    active: bool


class NoteCheck(TypedDict):
    """A preference note checked against a version that went live (daemon/retirement.py)."""

    note_id: int | None
    version: int
    gap_live: float
    gap_note: float
    margin: float
    retired: bool


class DaemonOutcome(TypedDict):
    """What the daemon did in the cell."""

    steps: list[TrainStepRow]
    samples: SampleCounts
    versions: NotRequired[Versions]
    memory_notes: NotRequired[list[MemoryNote]]
    memory_checks: NotRequired[list[NoteCheck]]


class SimConfigFields(TypedDict):
    """`SimConfig` as JSON (config.py)."""

    interactions: int
    batch_size: int
    lr: float
    lora_rank: int
    lora_alpha: int
    max_tokens: int
    temperature: float
    eval_tasks: int
    eval_points: NotRequired[int]
    kl_coef: NotRequired[float]
    threads: int
    thumbs_down_below: float
    move_on: float
    user_llm: NotRequired[str | None]
    gate: NotRequired[bool]


class CellHeader(TypedDict):
    """The fields every cell file has, whatever its scenario."""

    cell: CellKey
    config: SimConfigFields
    model: str
    user: NotRequired[str]  # who judged: "rules", "llm:MODEL@URL", the shell's checker
    code: NotRequired[CodeStamp]
    clawback_version: NotRequired[str]
    settings: dict[str, object]  # the daemon's Settings less its paths, passed through
    train_config: dict[str, object] | None  # the TrainConfig it trained with, passed through
    wall_s: float
    resumed_at: NotRequired[list[int]]
    base_eval_from: NotRequired[str | None]
    finished_at: str


class CellRecord(CellHeader, DaemonOutcome):
    """One finished cell: cells/<scenario>/<method>/seed<k>.json."""

    eval_tasks: int
    curve: list[CurvePoint]
    probe: NotRequired[list[ProbePoint]]
    final_score: float
    interactions: list[Interaction]
    reactions: dict[str, int]
    eval_replies: EvalReplies


class Progress(TypedDict):
    """A cell's progress so far: all that a checkpoint saves besides the daemon's own state."""

    next: int  # the next interaction
    wall_s: float  # spent before this process
    resumed_at: list[int]
    curve: list[CurvePoint]
    interactions: list[Interaction]
    evals: EvalReplies
    base_eval_from: str | None
    probes: list[ProbePoint]
    probed_notes: list[str]  # the notes the newest probe saw


class ProgressEvent(TypedDict):
    """What a running cell reports: an interaction done, or an evaluation's score."""

    interaction: int
    version: NotRequired[int | None]
    score: NotRequired[float]
