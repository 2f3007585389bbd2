"""Comments and docs that name things in the repository name things that exist: every `sql/NNNN`
is a migration (and, cited for a table or view, the one that holds it); every repository path is a
file or folder (`path::name` a function or class in it); every skipped migration number is
explained in sql/README.md. The commonest drift: code moves, the prose that points at it stays."""

import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".sql", ".toml", ".yaml", ".yml", ".sh", ".j2"}
#: files quoting other projects' paths (upstream sources of the test fixtures)
FOREIGN = ("tests/fixtures/",)
#: paths that exist only after a run (generated, ignored by git)
GENERATED = {"bench/results.json"}
TOP_FOLDERS = ("agents", "gpuledger", "streams", "schemas", "sql", "tests", "docs", "bench", "deploy", "scripts",
               "superset", ".ci")
PATH = re.compile(rf"(?<![\w/.-])((?:{'|'.join(map(re.escape, TOP_FOLDERS))})/[\w/.-]*\w)(?:::(\w+))?")
PLACEHOLDER = re.compile(r"(?:^|/)[A-Z]{3,}(?:[./]|$)")  # sql/NNNN, docs/NAME.md
SQL_REF = re.compile(r"sql/(\d{4})(?![\w])")
SQL_OBJECT = re.compile(r"CREATE\s+(?:OR\s+REPLACE\s+)?(?:TABLE|VIEW|MATERIALIZED\s+VIEW)\s+(?:IF\s+NOT\s+EXISTS\s+)?"
                        r"`?(\w+)`?", re.IGNORECASE)
#: drift known and owned elsewhere: (file, the name cited, the migration cited). Each must still be
#: wrong (the test says when to drop it).
KNOWN_DRIFT: set[tuple[str, str, str]] = set()


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / n for n in names if Path(n).suffix in TEXT_SUFFIXES and not n.startswith(FOREIGN)
            and (ROOT / n).is_file()]


def migrations() -> dict[str, Path]:
    return {p.name[:4]: p for p in (ROOT / "sql").glob("[0-9][0-9][0-9][0-9]_*.sql")}


def wheel_to_checkout(path: str) -> str:
    """A path in the installed layout (gpuledger/sql/...) as the checkout's (sql/...), from pyproject.toml."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for package, folder in sorted(package_dir.items(), key=lambda kv: -len(kv[0])):
        prefix = package.replace(".", "/")
        if path == prefix or path.startswith(prefix + "/"):
            return folder + path[len(prefix):]
    return path


def references(pattern: re.Pattern) -> list[tuple[str, int, str, re.Match]]:
    found = []
    for file in tracked_text_files():
        for lineno, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            found += [(file.relative_to(ROOT).as_posix(), lineno, line, m) for m in pattern.finditer(line)]
    return found


def test_every_cited_migration_exists():
    known = migrations()
    missing = [f"{f}:{n}: sql/{m.group(1)}" for f, n, _, m in references(SQL_REF) if m.group(1) not in known]
    assert not missing, "these name a migration that does not exist:\n" + "\n".join(missing)


def test_a_migration_cited_for_a_table_or_view_holds_it():
    known = migrations()
    objects = {name for p in known.values() for name in SQL_OBJECT.findall(p.read_text())}
    wrong, seen_known = [], set()
    for file, lineno, line, m in references(SQL_REF):
        number = m.group(1)
        if number not in known:
            continue  # the test above
        # the table or view the citation is for: the last one named just before it
        named = [a or b for a, b in re.findall(r"`(\w+)`|\b(\w+)\b", line[max(0, m.start() - 40):m.start()])]
        cited = [n for n in named if n in objects]
        if not cited or cited[-1] in known[number].read_text():
            continue
        if (file, cited[-1], number) in KNOWN_DRIFT:
            seen_known.add((file, cited[-1], number))
            continue
        holders = sorted(v for v, p in known.items() if re.search(rf"\b{cited[-1]}\b", p.read_text()))
        wrong.append(f"{file}:{lineno}: {cited[-1]} is cited as sql/{number}, but is in sql/{'|'.join(holders)}")
    assert not wrong, "\n".join(wrong)
    fixed = KNOWN_DRIFT - seen_known
    assert not fixed, f"fixed, drop from KNOWN_DRIFT: {sorted(fixed)}"


def test_every_repository_path_named_exists():
    missing = []
    for file, lineno, _, m in references(PATH):
        path = m.group(1).rstrip(".")
        if SQL_REF.fullmatch(path) or path in GENERATED or PLACEHOLDER.search(path):
            continue
        candidates = [ROOT / path, ROOT / wheel_to_checkout(path)]
        target = next((c for c in candidates if c.exists()), None)
        if target is None and not any(c.parent.is_dir() and any(c.parent.glob(c.name + "*")) for c in candidates):
            missing.append(f"{file}:{lineno}: {path}")  # a prefix (tests/unit/test_kubernetes_) is fine
        elif target is not None and m.group(2) and target.is_file() and not re.search(
                rf"^\s*(?:async\s+)?(?:def|class)\s+{m.group(2)}\b", target.read_text(), re.MULTILINE):
            missing.append(f"{file}:{lineno}: {path}::{m.group(2)} (no such function or class)")
    assert not missing, "these name a path that does not exist:\n" + "\n".join(missing)


def test_every_skipped_migration_number_is_explained():
    numbers = sorted(int(v) for v in migrations())
    skipped = [f"{n:04d}" for n in range(numbers[0], numbers[-1]) if n not in numbers]
    notes = (ROOT / "sql" / "README.md").read_text()
    assert all(n in notes for n in skipped), f"sql/README.md does not explain the skipped numbers {skipped}"


@pytest.mark.parametrize("stale", ["node_inventory_rows"])
def test_names_known_to_be_gone_are_not_mentioned(stale):
    mentions = [f"{f}:{n}" for f, n, _, _ in references(re.compile(rf"\b{stale}\b"))
                if not f.endswith("test_docs_drift.py")]
    assert not mentions, f"{stale} no longer exists, but is named at {mentions}"
