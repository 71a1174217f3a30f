"""The performance suite: every section in one run, one report.

    python -m bench.perf.performance [--quick] [--soak-s 600] [--only latency,scale,...]
                                [--output-dir bench/results]

Sections, each a module with `run(options: PerfOptions) -> Section` (bench/perf/perfreport.py):

    1    latency   bench.perf.latency   added latency and sustainable rate vs LiteLLM
    2, 3 scale     bench.perf.scale     gateway scaling 1/2/4 processes; Redis cost per request
    4    tokens    bench.perf.tokens    token estimation, cold and warm, 1/8/32 KB chats
    5    release   bench.perf.release   scheduler release throughput and latency
    6    memory    bench.perf.memory    Redis bytes per queued task, gateway RSS, soak

They run one after another, never two at once: the machine has two cores, and any overlap
would measure the neighbour. A section that raises is recorded as failed, with its error, and
the suite goes on. Modules are imported by name only when their turn comes, so one that is
missing or broken is reported, not a crash of the whole run. Results: performance.md (header
with the machine and its load, a table of every check, then each section and its charts) and
performance.json (each section's data). The exit code is 1 when a check is missed or a section
failed, 130 when interrupted (the report of what ran is still written).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.perf.perfreport import Check, PerfOptions, Section

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SectionSpec:
    key: str
    module: str
    numbers: tuple[str, ...]
    """The suite's section numbers this module covers (scale covers two)."""
    title: str
    """Used when the module fails before naming its own sections."""


SPECS: tuple[SectionSpec, ...] = (
    SectionSpec("latency", "bench.perf.latency", ("1",), "Latency vs LiteLLM"),
    SectionSpec("scale", "bench.perf.scale", ("2", "3"),
                "Gateway scaling and Redis cost per request"),
    SectionSpec("tokens", "bench.perf.tokens", ("4",), "Token estimation latency"),
    SectionSpec("release", "bench.perf.release", ("5",), "Scheduler release"),
    SectionSpec("memory", "bench.perf.memory", ("6",), "Memory"),
)
KEYS = tuple(s.key for s in SPECS)


@dataclass
class Outcome:
    """What one section module gave: its sections, or the error it failed with."""

    spec: SectionSpec
    sections: list[Section] = field(default_factory=list)
    error: str | None = None
    detail: str = ""
    """The traceback of a failure, for performance.json."""
    elapsed_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.error is not None

    def labelled(self) -> list[tuple[str, Section]]:
        """Each section with its number: one per issue number when the counts agree, else the
        first section carries all of them (a module may fold 2 and 3 into one section)."""
        numbers = self.spec.numbers
        if len(self.sections) == len(numbers):
            return list(zip(numbers, self.sections, strict=True))
        if len(self.sections) == 1:
            return [(" and ".join(numbers), self.sections[0])]
        return [(f"{numbers[0]}.{i + 1}", s) for i, s in enumerate(self.sections)]

    def checks(self) -> list[Check]:
        return [c for s in self.sections for c in s.checks]


@dataclass
class RunInfo:
    """The report's header: what ran, where, and how busy the machine was."""

    command: str
    started: str
    revision: str
    cpus: int | None
    python: str
    redis: str
    load_start: tuple[float, float, float]
    quick: bool
    load_end: tuple[float, float, float] = (0.0, 0.0, 0.0)
    duration_s: float = 0.0


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def revision() -> str:
    """HEAD, and whether the tree had uncommitted changes (then the figures may not be HEAD's)."""
    head = _git("rev-parse", "--short=12", "HEAD") or "unknown"
    changed = _git("status", "--porcelain", "--untracked-files=no")
    return f"{head} (+ uncommitted changes)" if changed else head


def redis_version() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        return "not installed"
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    for word in out.stdout.split():  # "Redis server v=7.0.15 sha=... bits=64 ..."
        if word.startswith("v="):
            return word[2:]
    return out.stdout.strip() or "unknown"


def _loadavg() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


def run_one(spec: SectionSpec, options: PerfOptions) -> Outcome:
    outcome = Outcome(spec)
    started = time.perf_counter()
    try:
        try:
            module = importlib.import_module(spec.module)
        except ModuleNotFoundError as e:
            if e.name != spec.module:
                raise  # the module exists but something it imports does not
            raise RuntimeError(f"module {spec.module} not found") from e
        result = module.run(options)
        sections = result if isinstance(result, list) else [result]
        if not sections or not all(isinstance(s, Section) for s in sections):
            raise TypeError(f"{spec.module}.run returned {type(result).__name__}, not Section")
        outcome.sections = sections
    except (Exception, SystemExit) as e:  # a section's failure must not end the suite
        outcome.error = f"{type(e).__name__}: {e}"
        outcome.detail = traceback.format_exc()
    outcome.elapsed_s = time.perf_counter() - started
    return outcome


def run_suite(specs: Sequence[SectionSpec], options: PerfOptions,
              progress: Callable[[str], None] = print) -> tuple[list[Outcome], bool]:
    """Every section in turn; (outcomes, interrupted). Ctrl-C stops the run but keeps what
    finished, so a long run that is cut short still leaves its report."""
    outcomes: list[Outcome] = []
    for i, spec in enumerate(specs, 1):
        progress(f"[{i}/{len(specs)}] {spec.key} ({spec.module}) running")
        gc.collect()  # the previous section's garbage is not this one's pause
        try:
            outcome = run_one(spec, replace_workdir(options, spec.key))
        except KeyboardInterrupt:
            progress(f"[{i}/{len(specs)}] {spec.key} interrupted")
            outcomes.append(Outcome(spec, error="interrupted"))
            return outcomes, True
        outcomes.append(outcome)
        if outcome.failed:
            progress(f"[{i}/{len(specs)}] {spec.key} FAILED after {outcome.elapsed_s:.0f} s: "
                     f"{outcome.error}\n{outcome.detail}")
        else:
            checks = outcome.checks()
            missed = [c.name for c in checks if not c.met]
            progress(f"[{i}/{len(specs)}] {spec.key} done in {outcome.elapsed_s:.0f} s: "
                     f"{len(checks) - len(missed)}/{len(checks)} checks met"
                     + (f"; missed: {', '.join(missed)}" if missed else ""))
    return outcomes, False


def replace_workdir(options: PerfOptions, key: str) -> PerfOptions:
    """Each section its own scratch directory, so leftovers of one never confuse the next."""
    workdir = options.workdir / key
    workdir.mkdir(parents=True, exist_ok=True)
    return PerfOptions(results_dir=options.results_dir, workdir=workdir, quick=options.quick,
                       soak_s=options.soak_s)


def exit_code(outcomes: Sequence[Outcome]) -> int:
    failed = any(o.failed for o in outcomes)
    missed = any(not c.met for o in outcomes for c in o.checks())
    return 1 if failed or missed else 0


def _cell(text: str, limit: int = 0) -> str:
    """Table cells hold one line without pipes; `limit` shortens long ones (an error carrying a
    whole command line), whose full text is in the section below."""
    text = " ".join(text.split())
    if limit and len(text) > limit:
        text = text[:limit - 1] + "…"
    return text.replace("|", "\\|")


def _load(load: tuple[float, float, float]) -> str:
    return " / ".join(f"{x:.2f}" for x in load)


def render(info: RunInfo, outcomes: Sequence[Outcome], output_dir: Path) -> str:
    lines = [
        "# Performance",
        "",
        f"`{info.command}`, started {info.started}, {info.duration_s / 60:.1f} min.",
        "",
        f"- revision: `{info.revision}`",
        f"- machine: {info.cpus} CPUs ({platform.machine()}), {platform.system()}, "
        f"Python {info.python}, redis-server {info.redis}",
        f"- load average (1/5/15 min): {_load(info.load_start)} at start, "
        f"{_load(info.load_end)} at end",
    ]
    if info.quick:
        lines += ["", "**Quick run** (`--quick`): short phases and small counts; it shows that "
                  "every section runs, its figures are not the targets' measurements."]
    lines += ["", "## Checks", "",
              "| § | check | target | measured | result |", "|---|---|---|---|---|"]
    for o in outcomes:
        for number, section in o.labelled():
            for c in section.checks:
                result = "met" if c.met else "**missed**"
                lines.append(f"| {number} | {_cell(c.name)} | {_cell(c.target)} | "
                             f"{_cell(c.value)} | {result} |")
        if o.failed:
            lines.append(f"| {', '.join(o.spec.numbers)} | {o.spec.title}: section did not "
                         f"complete | - | {_cell(o.error or '', 160)} | **failed** |")
    verdict = ("all checks met" if exit_code(outcomes) == 0
               else "**not all checks met, or a section failed**")
    lines += ["", f"Overall: {verdict}.", "", "| section | module | time | status |",
              "|---|---|---:|---|"]
    for o in outcomes:
        status = "failed" if o.failed else "ran"
        lines.append(f"| {', '.join(o.spec.numbers)} ({o.spec.key}) | `{o.spec.module}` | "
                     f"{o.elapsed_s:.0f} s | {status} |")
    for o in outcomes:
        if o.failed:
            lines += ["", f"## {' and '.join(o.spec.numbers)}. {o.spec.title}: failed", "",
                      "```", (o.detail or o.error or "").rstrip(), "```"]
            continue
        for number, section in o.labelled():
            lines += ["", f"## {number}. {section.title}", "", section.markdown.rstrip()]
            for chart in section.charts:
                link = Path(os.path.relpath(chart, output_dir)).as_posix()
                if f"]({link})" not in section.markdown:  # the section placed it already
                    lines += ["", f"![{section.title}: {chart.stem}]({link})"]
    return "\n".join(lines) + "\n"


def to_json(info: RunInfo, outcomes: Sequence[Outcome]) -> dict[str, Any]:
    sections: dict[str, Any] = {}
    for o in outcomes:
        sections[o.spec.key] = {
            "module": o.spec.module,
            "elapsed_s": o.elapsed_s,
            "error": o.error,
            "traceback": o.detail or None,
            "sections": [{"number": n, "title": s.title, "checks": [asdict(c) for c in s.checks],
                          "charts": [str(c) for c in s.charts], "data": s.data}
                         for n, s in o.labelled()],
        }
    return {"run": asdict(info), "exit_code": exit_code(outcomes), "sections": sections}


def write_report(info: RunInfo, outcomes: Sequence[Outcome], output_dir: Path) -> tuple[Path, Path]:
    output_dir.mkdir(parents=True, exist_ok=True)
    md = output_dir / "performance.md"
    md.write_text(render(info, outcomes, output_dir), encoding="utf-8")
    js = output_dir / "performance.json"
    # default=str: a section's data may hold a Path or a datetime; the report must still land.
    js.write_text(json.dumps(to_json(info, outcomes), indent=1, default=str) + "\n",
                  encoding="utf-8")
    return md, js


def parse_only(value: str) -> list[str]:
    keys = [k.strip() for k in value.split(",") if k.strip()]
    unknown = [k for k in keys if k not in KEYS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(KEYS)}")
    return keys


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench.perf.performance",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="short phases: shows every section runs (minutes, not an hour)")
    parser.add_argument("--soak-s", type=float, default=600.0,
                        help="length of the memory section's soak (default 600)")
    parser.add_argument("--only", type=parse_only, default=list(KEYS),
                        help=f"comma-separated sections, from {','.join(KEYS)}")
    parser.add_argument("--output-dir", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(args_list)

    specs = [s for s in SPECS if s.key in args.only]  # always in issue order
    info = RunInfo(
        command=shlex.join(["python", "-m", "bench.perf.performance", *args_list]),
        started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        revision=revision(),
        cpus=os.cpu_count(),
        python=platform.python_version(),
        redis=redis_version(),
        load_start=_loadavg(),
        quick=args.quick,
    )
    print(f"{info.command}: {len(specs)} section(s), revision {info.revision}, "
          f"load {_load(info.load_start)}", flush=True)
    output_dir: Path = args.output_dir.resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-perf-"))
    options = PerfOptions(results_dir=output_dir, workdir=workdir, quick=args.quick,
                          soak_s=args.soak_s)
    started = time.perf_counter()
    try:
        outcomes, interrupted = run_suite(specs, options,
                                          lambda line: print(line, flush=True))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    info.duration_s = time.perf_counter() - started
    info.load_end = _loadavg()
    md, js = write_report(info, outcomes, output_dir)
    code = 130 if interrupted else exit_code(outcomes)
    print("\n" + "\n".join(_summary(outcomes)))
    print(f"wrote {md} and {js}; exit code {code}")
    return code


def _summary(outcomes: Sequence[Outcome]) -> list[str]:
    """The checks table for the terminal, one line each."""
    lines = []
    for o in outcomes:
        if o.failed:
            lines.append(f"FAILED  {o.spec.key}: {o.error}")
        for c in o.checks():
            lines.append(f"{'met   ' if c.met else 'MISSED'}  {c.name}: {c.value} "
                         f"(target {c.target})")
    return lines


if __name__ == "__main__":
    sys.exit(main())
