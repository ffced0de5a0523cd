"""Only the store speaks SQL: no module outside clawback/daemon/store/ runs a statement or holds one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "clawback"
STORE = ROOT / "daemon" / "store"
RUNS_SQL = {"execute", "executemany", "executescript"}
# A statement starts with its keyword and goes on as SQL does: prose that starts with "Delete" or
# "select", a file's ".sql" suffix or an action named "update" is none.
STATEMENT = re.compile(r"\s*(SELECT\s.*\bFROM\s|INSERT\s+(OR\s+\w+\s+)?INTO\s|UPDATE\s+\w+\s+SET\s|DELETE\s+FROM\s"
                       r"|CREATE\s+(TEMP\w*\s+|UNIQUE\s+|VIRTUAL\s+)?(TABLE|INDEX|TRIGGER|VIEW)\s|PRAGMA\s+\w)",
                       re.IGNORECASE | re.DOTALL)


def sql_in(path: Path) -> list[str]:
    """Where `path` runs SQL (`.execute(...)` and kin) or holds a string that starts as a statement."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in RUNS_SQL:
            found.append(f"{path}:{node.lineno}: .{node.func.attr}(...)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and STATEMENT.match(node.value):
            found.append(f"{path}:{node.lineno}: {node.value[:60]!r}")
    return found


def test_no_module_outside_the_store_speaks_sql() -> None:
    found = [hit for path in sorted(ROOT.rglob("*.py")) if STORE not in path.parents for hit in sql_in(path)]
    assert not found, "SQL outside clawback/daemon/store/ (add a query method to the store):\n" + "\n".join(found)


def test_the_scan_finds_a_statement_and_a_call_and_lets_other_text_be(tmp_path: Path) -> None:
    planted = tmp_path / "planted.py"
    planted.write_text('def f(c):\n    q = "select count(*) FROM calls"\n    return c.executemany(q, [])\n')
    assert sorted(hit.split(": ", 1)[1] for hit in sql_in(planted)) == ["'select count(*) FROM calls'", ".executemany(...)"]
    clean = tmp_path / "clean.py"
    clean.write_text('SUFFIXES = (".sql", ".py")\nWHY = "Selected replies; update the notes"\nACTION = "delete"\n'
                     'HELP = "Delete what was stored about a session"\n')
    assert sql_in(clean) == []
