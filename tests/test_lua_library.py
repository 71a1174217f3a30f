"""The Lua library's layout, and every pointer into it from the code and the docs.

Each script runs as the library files (`admission.scripts.LIBRARY`) followed by its own file,
one chunk. A helper is a `local`, visible only below its definition: a file that calls a helper
defined in a later file compiles, and reads a nil global at run time, only on the path that
calls it. So the order is checked here, for every file, not left to the tests that happen to
reach each path. Comments and docs point at helpers as ``place() in lua/_place.lua``,
``lua/_room.lua prefill_of`` or ``"Fair release" in _tenant.lua``; each must name the file
that defines the helper or holds the section.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from admission.scripts import LIBRARY, SCRIPT_NAMES

ROOT = Path(__file__).resolve().parents[1]
LUA = ROOT / "lua"
MAX_LINES = 500
"""The project's habit for a module's size, Lua files included."""

DEFINITION = re.compile(r"^local (?:function (\w+)|([\w, ]+?)\s*=)", re.MULTILINE)
COMMENT = re.compile(r"--[^\n]*")
STRING = re.compile(r"'[^'\n]*'")
WORD = re.compile(r"\b([A-Za-z_]\w*)\b")
LIB_FILE = r"(?:lua/)?(_[a-z]+\.lua)"
# place() in lua/_place.lua, `place()` in `lua/_place.lua`
CALL_IN = re.compile(r"`?(\w+)\(\)`?\s+in\s+`?" + LIB_FILE)
# lua/_room.lua prefill_of, `lua/_tenant.lua` VT_SCALE, lua/_lib.lua's running_member,
# (`lua/_lib.lua`, `now_us`)
FILE_THEN = re.compile(LIB_FILE + r"`?(?:'s)?,?\s+`?(\w+)")
# "Fair release" in _tenant.lua, (`lua/_tenant.lua`, "Fair release")
TITLE_IN = re.compile(r'"([A-Z][a-z ]+)"\s+in\s+`?' + LIB_FILE)
FILE_TITLE = re.compile(LIB_FILE + r'`?,\s+"([A-Z][a-z ]+)"')


def source(name: str) -> str:
    return (LUA / f"{name}.lua").read_text(encoding="utf-8")


def defined(text: str) -> set[str]:
    names: set[str] = set()
    for m in DEFINITION.finditer(text):
        names.update(n.strip() for n in (m.group(1) or m.group(2)).split(","))
    return names


def used(text: str) -> set[str]:
    return set(WORD.findall(STRING.sub("", COMMENT.sub("", text))))


DEFINED = {name: defined(source(name)) for name in LIBRARY}
ALL_HELPERS = set().union(*DEFINED.values())


def test_every_library_file_is_loaded_and_every_loaded_file_exists() -> None:
    on_disk = {p.stem for p in LUA.glob("_*.lua")}
    assert on_disk == set(LIBRARY)


@pytest.mark.parametrize("name", [*LIBRARY, *SCRIPT_NAMES])
def test_lua_files_stay_small(name: str) -> None:
    assert len(source(name).splitlines()) <= MAX_LINES


@pytest.mark.parametrize("index", range(len(LIBRARY)))
def test_library_files_use_only_what_comes_before_them(index: int) -> None:
    name = LIBRARY[index]
    later = set().union(set(), *(DEFINED[n] for n in LIBRARY[index + 1:])) - DEFINED[name]
    assert not used(source(name)) & later, f"{name}.lua uses helpers defined after it"


def test_no_helper_is_defined_twice() -> None:
    seen: dict[str, str] = {}
    for name in LIBRARY:
        for helper in DEFINED[name]:
            assert helper not in seen, f"{helper} in {seen.get(helper)}.lua and {name}.lua"
            seen[helper] = name


def pointers() -> list[tuple[str, str, str, str]]:
    """(where, library file, helper or section title, kind) for every pointer found."""
    files = [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md"), *LUA.glob("*.lua")]
    for package in ("admission", "gateway", "scheduler", "bench", "tests"):
        files += (ROOT / package).rglob("*.py")
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8")
        where = str(path.relative_to(ROOT))
        for m in CALL_IN.finditer(text):
            found.append((where, m.group(2), m.group(1), "helper"))
        for m in FILE_THEN.finditer(text):
            if m.group(2) in ALL_HELPERS:
                found.append((where, m.group(1), m.group(2), "helper"))
        for m in TITLE_IN.finditer(text):
            found.append((where, m.group(2), m.group(1), "title"))
        for m in FILE_TITLE.finditer(text):
            found.append((where, m.group(1), m.group(2), "title"))
    return found


def test_pointers_are_found() -> None:
    # The patterns must keep matching the way the code and docs point (a pattern that found
    # nothing would pass the next test vacuously).
    found = pointers()
    assert len(found) >= 30 and {kind for _, _, _, kind in found} == {"helper", "title"}


def test_every_pointer_names_the_file_that_holds_it() -> None:
    wrong = []
    for where, file, what, kind in pointers():
        stem = file.removesuffix(".lua")
        if stem not in DEFINED:
            wrong.append(f"{where}: {file} is not a library file")
        elif kind == "helper" and what not in DEFINED[stem]:
            owner = [n for n in LIBRARY if what in DEFINED[n]]
            wrong.append(f"{where}: {what} is in {owner}, not {file}")
        elif kind == "title" and f"-- {what}" not in source(stem):
            wrong.append(f'{where}: no section "{what}" in {file}')
    assert not wrong, "\n".join(wrong)
