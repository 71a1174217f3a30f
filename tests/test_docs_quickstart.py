"""The README's "Running it against your vLLM servers" steps hold together as written.

A reader follows them in a fresh virtual environment, so the install step must bring every
module the later steps import or name (the SDK example's `openai`, `kvgate_client`), and every
command the steps run must exist and take the flags they pass. Read out of the README itself,
so an edit that drops a package from the install line or renames a flag fails here."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Running it against your vLLM servers"


def section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.DOTALL)


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalized ("prometheus-client>=0.19" -> ...)."""
    found = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert found is not None, requirement
    return re.sub(r"[-_.]+", "-", found[0]).lower()


def installed_by(spec: str) -> set[str]:
    """Top-level modules a local `pip install -e 'DIR[extras]'` provides: DIR's own packages
    and the distributions it pulls (named as modules: `openai`, `redis`, ...)."""
    found = re.fullmatch(r"([^\[]+)(?:\[([^\]]*)\])?", spec)
    assert found is not None, spec
    project = tomllib.loads((ROOT / found[1] / "pyproject.toml").read_text())
    setuptools = project.get("tool", {}).get("setuptools", {})
    own = set(setuptools.get("packages", [])) or {
        pattern.rstrip("*") for pattern in setuptools["packages"]["find"]["include"]}
    requirements = list(project["project"]["dependencies"])
    for extra in filter(None, (found[2] or "").split(",")):
        requirements += project["project"]["optional-dependencies"][extra]
    return own | {_name(r).replace("-", "_") for r in requirements}


def test_the_install_step_brings_what_the_later_steps_import() -> None:
    text = section()
    (install,) = [line for code in blocks(text, "bash") for line in code.splitlines()
                  if line.strip().startswith("pip install")]
    words = shlex.split(install)
    specs = [words[i + 1] for i, word in enumerate(words) if word == "-e"]
    assert specs, install
    provided = set().union(*(installed_by(spec) for spec in specs))
    imported = {module for code in blocks(text, "python")
                for module in re.findall(r"^\s*(?:import|from)\s+(\w+)", code, re.MULTILINE)}
    named = set(re.findall(r"`(kvgate_client)\.", (ROOT / "README.md").read_text()))
    assert imported and named, (imported, named)
    assert imported | named <= provided, sorted((imported | named) - provided)


def test_every_command_the_steps_run_takes_the_flags_they_pass() -> None:
    text = section()
    runs: dict[tuple[str, ...], set[str]] = {}
    for code in blocks(text, "bash"):
        for line in code.splitlines():
            for part in re.split(r"&&|&|;", line.split("#", 1)[0]):
                words = shlex.split(part)
                if words[:2] == ["python", "-m"]:
                    command: tuple[str, ...] = (sys.executable, "-m", words[2])
                elif words[:1] == ["kvgate-inspect"]:
                    command = (sys.executable, "-m", "admission.inspect")
                else:
                    continue
                runs.setdefault(command, set()).update(w for w in words if w.startswith("--"))
    # The steps' prose runs kvgate-inspect with its flags in backticks.
    for flags in re.findall(r"`kvgate-inspect ([^`]*)`", text):
        runs.setdefault((sys.executable, "-m", "admission.inspect"), set()).update(
            w for w in shlex.split(flags) if w.startswith("--"))
    # Flags alone in backticks are kvgate-inspect's ("`--watch` refreshes, `--json` ...").
    runs[(sys.executable, "-m", "admission.inspect")] |= set(re.findall(r"`(--\w+)`", text))
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["kvgate-inspect"] == "admission.inspect:main"
    modules = {command[2] for command in runs}
    assert {"bench.sim", "scheduler", "gateway", "admission.inspect"} <= modules, modules
    for command, flags in runs.items():
        result = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True,
                                timeout=60, check=False)
        assert result.returncode == 0, (command, result.stderr[-2000:])
        accepted = set(re.findall(r"(--[a-z][a-z0-9-]*)", result.stdout))
        assert flags <= accepted, (command[2], sorted(flags - accepted))
