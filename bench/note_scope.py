"""How often does `daemon.memory.scope` give a note the scope its words mean?

Two sets, no model: every note the simulator's person can leave (each scenario's correction for
every combination of failed checks, after each kind of broken reply, and its up-front preference;
all of them are about replies in general), and hand-written corrections of both kinds, a
preference about replies in general and one about the task at hand, labelled by what they mean.

    .venv/bin/python bench/note_scope.py [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json

from clawback.daemon.memory import notes_from, scope
from clawback.sim.scenarios import SCENARIOS, Rating

# Preferences about replies in general: they hold for every conversation.
GENERAL = [
    "Please start your reply with 'Sure!'.", "Don't use markdown.", "Keep answers short.",
    "Please don't use bullet points.", "Write in British English.", "Stop apologising so much.",
    "Use metric units.", "Always show your reasoning before the answer.", "Answer in under 50 words.",
    "Please address me as Sam.", "No emojis, please.", "Put code in fenced blocks with the language name.",
    "I'd prefer plain sentences over lists.", "Be more direct and skip the preamble.", "From now on, reply in French.",
    "Please use type hints in Python code.", "Don't end with a summary paragraph.", "Keep it between 2 and 3 sentences.",
    "Use 4 spaces for indentation.", "Could you please not use headers?", "Round money to 2 decimal places.",
    "Please write numbers as digits, not words.", "Cite your sources when you state facts.",
    "Don't say 'As an AI'.", "Give the answer first, then the explanation.", "Use lowercase letters only.",
]
# Corrections about the task at hand: they hold for its conversation only.
SESSION = [
    "Answer with just the number, like: 4.", "The answer is 12, not 4.", "Use pandas for this one.", "And a string?",
    "This time, use a loop instead of recursion.", "Please recheck this calculation.",
    "The function should return None when the list is empty.", "For this question, assume the train leaves at 9.",
    "Use the data from the table above.", "Here, the total should be 45.", "What about negative numbers?",
    "Try it again with 7 instead of 5.", "Call the variable total_price.", "Please fix the bug on line 3.",
    "In this conversation, call me Captain.", "The file is called report.csv, not data.csv.",
    "Please translate the second paragraph too.", "Make this one shorter.", "Don't use recursion for this task.",
    "It should be 3.5, not 3.", "Please use the numbers I gave you, not new ones.", "Can you do it in Rust instead?",
    "Skip the intro for now.", "Explain step 2 again.", "The question asks for minutes, not hours.",
]


def simulator_notes() -> list[str]:
    """Every distinct note a simulated correction or preference makes."""
    notes: dict[str, None] = {}
    for scen in SCENARIOS.values():
        texts = [scen.preference]
        for k in range(1, len(scen.checks) + 1):
            for failed in itertools.combinations(scen.checks, k):
                texts += [scen.correction(Rating(0.0, failed, gate)) for gate in (None, "cut", "meta", "repeat")]
        for text in texts:
            notes.update(dict.fromkeys(notes_from(text)[0]))
    return list(notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args()
    sets = {"simulator notes (general)": (simulator_notes(), "general"), "hand-written general": (GENERAL, "general"),
            "hand-written session": (SESSION, "session")}
    result = {}
    for name, (texts, want) in sets.items():
        wrong = [t for t in texts if scope(t) != want]
        result[name] = {"cases": len(texts), "right": len(texts) - len(wrong), "wrong": wrong}
    hand = [result["hand-written general"], result["hand-written session"]]
    result["hand-written, both"] = {"cases": sum(r["cases"] for r in hand), "right": sum(r["right"] for r in hand)}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print("| set | cases | right | accuracy |\n|---|---|---|---|")
    for name, r in result.items():
        print(f"| {name} | {r['cases']} | {r['right']} | {r['right'] / r['cases']:.2f} |")
    for name, r in result.items():
        for t in r.get("wrong", []):
            print(f"wrong ({name}): {t}")


if __name__ == "__main__":
    main()
