"""Every error code, header and metric the docs name is one the code defines.

What the docs promise on the wire is read out of them with narrow patterns, so prose is free:

- error code: a backticked snake_case word right after a 4xx/5xx status
  ("429 `capacity_exceeded`", "429 `a` / `b`", "429 `a` or `b`"), a JSON `"code": "..."`, or
  the backticked list right after the word `code` ("the gateway's `code` (`a` or `b`)"); a
  rejection *reason* written "(reason `zone_red`)" is a metric label, not a code, and is not
  taken;
- header: `X-...` names, `Retry-After`, `retry-after-ms` and `x-should-retry`, any case;
- metric: `kvgate_` names other than the Python package names (`kvgate_client`).

What the code defines is read out of it: error codes from the gateway's source (every `code=`
argument and the first argument of `too_many_requests`, constants resolved, `f"upstream_{kind}"`
expanded over the kinds its callers pass, and the HTTP-status table), header names from the
gateway's string literals, metric names from the services' own registries as a scrape shows them
(so with the `_total`, `_bucket`, `_count`, `_sum` samples Prometheus adds).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.test_grafana_dashboard import EXPORTED

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(
    [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", ROOT / "clients/python/README.md",
     ROOT / "clients/go/README.md",
     *(ROOT / "helm").glob("*/README.md"), *(ROOT / "helm").glob("*/templates/NOTES.txt")]
)
GATEWAY = sorted((ROOT / "gateway").rglob("*.py"))
CLIENT = sorted((ROOT / "clients/python/kvgate_client").rglob("*.py"))
# Names starting with kvgate_ that are Python packages, not metrics.
PACKAGES = {"kvgate_client"}

CODE_WORD = r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`"
# Alternatives are joined by "/" or "or"; a comma after a code starts prose ("503
# `admission_unavailable`, `kvgate_gateway_redis_errors_total` rising").
AFTER_STATUS = re.compile(r"\b[45]\d\d\s+" + CODE_WORD + r"((?:\s*(?:/|or)\s*`[a-z0-9_]+`)*)")
AFTER_CODE = re.compile(r"\bcode`?\s*\(((?:`[a-z0-9_]+`(?:\s*(?:,|/|or)\s*)?)+)\)")
JSON_CODE = re.compile(r'"code":\s*"([a-z0-9_]+)"')
HEADER = re.compile(r"\b(X-[A-Za-z0-9-]*[A-Za-z0-9]|retry-after(?:-ms)?|x-should-retry)\b",
                    re.IGNORECASE)
METRIC = re.compile(r"\bkvgate_[a-z0-9_]*[a-z0-9]\b")
HEADER_LITERAL = re.compile(r"^(x-[a-z0-9-]+|retry-after(-ms)?)$", re.IGNORECASE)


def doc_text(path: Path) -> str:
    # A table cell escapes pipes; the patterns read the text as rendered.
    return path.read_text(encoding="utf-8").replace("\\|", "|")


def error_codes_named(text: str) -> set[str]:
    found: set[str] = set()
    for match in AFTER_STATUS.finditer(text):
        found.add(match.group(1))
        found.update(re.findall(r"`([a-z0-9_]+)`", match.group(2)))
    for match in AFTER_CODE.finditer(text):
        found.update(re.findall(r"`([a-z0-9_]+)`", match.group(1)))
    found.update(JSON_CODE.findall(text))
    return found


def headers_named(text: str) -> set[str]:
    return {h.lower() for h in HEADER.findall(text)}


def metrics_named(text: str) -> set[str]:
    return set(METRIC.findall(text)) - PACKAGES


# --- what the code defines --------------------------------------------------------------------


def _constants(trees: list[ast.Module]) -> dict[str, str]:
    """Module-level NAME = "string" assignments, across the modules (names are unique enough)."""
    out: dict[str, str] = {}
    for tree in trees:
        for node in tree.body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and isinstance(node.value.value, str)):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        out[target.id] = node.value.value
    return out


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def _walk_functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def gateway_error_codes() -> set[str]:
    trees = [ast.parse(p.read_text(encoding="utf-8")) for p in GATEWAY]
    constants = _constants(trees)
    calls = [n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Call)]
    codes: set[str] = set()

    def resolve(node: ast.expr, function: ast.FunctionDef | ast.AsyncFunctionDef | None) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            codes.add(node.value)
        elif isinstance(node, ast.Name) and node.id in constants:
            codes.add(constants[node.id])
        elif isinstance(node, ast.JoinedStr) and function is not None:
            # f"upstream_{kind}": the prefix, then each string its callers pass for `kind`.
            parts = node.values
            if (len(parts) == 2 and isinstance(parts[0], ast.Constant)
                    and isinstance(parts[1], ast.FormattedValue)
                    and isinstance(parts[1].value, ast.Name)):
                prefix, param = str(parts[0].value), parts[1].value.id
                names = [a.arg for a in function.args.args]
                index = names.index(param) - (1 if names and names[0] == "self" else 0)
                for call in calls:
                    if _called_name(call) == function.name and len(call.args) > index:
                        arg = call.args[index]
                        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                            codes.add(prefix + arg.value)

    for tree in trees:
        for function in _walk_functions(tree):
            for call in ast.walk(function):
                if not isinstance(call, ast.Call):
                    continue
                for keyword in call.keywords:
                    if keyword.arg == "code":
                        resolve(keyword.value, function)
                if _called_name(call) == "too_many_requests" and call.args:
                    resolve(call.args[0], function)
        for node in ast.walk(tree):
            # {404: ("Not found: {path}", "not_found"), ...}: status -> (message, code).
            if isinstance(node, ast.Dict) and node.keys and all(
                    isinstance(k, ast.Constant) and isinstance(k.value, int) for k in node.keys):
                for value in node.values:
                    if isinstance(value, ast.Tuple) and len(value.elts) == 2:
                        resolve(value.elts[1], None)
    return codes


def header_literals(paths: list[Path]) -> set[str]:
    found: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and HEADER_LITERAL.match(node.value)):
                found.add(node.value.lower())
    return found


CODES = gateway_error_codes()
GATEWAY_HEADERS = header_literals(GATEWAY)
CLIENT_HEADERS = header_literals(CLIENT)


# --- the extraction itself --------------------------------------------------------------------


def test_the_extraction_reads_codes_headers_and_metrics_and_leaves_prose_alone() -> None:
    text = (
        "RED rejects (429 `capacity_exceeded`, counted with reason `zone_red`); the queue is\n"
        "capped: 429 `queue_full` / `tenant_queue_full`. Over the burst: 400 `exceeds_burst`.\n"
        'A body {"error": {"code": "invalid_json"}}. The SDK raises with the gateway\'s `code`\n'
        "(`capacity_exceeded` or `rate_limit_exceeded`). Port 8080 `gateway.port`, 150-250).\n"
        "`max_tokens` is a field; `kvgate_client` a package; `kvgate_gateway_requests_total` and\n"
        "`kvgate_scheduler_zone` metrics; headers X-Priority, `Retry-After`, retry-after-ms.\n"
    )
    assert error_codes_named(text) == {
        "capacity_exceeded", "queue_full", "tenant_queue_full", "exceeds_burst", "invalid_json",
        "rate_limit_exceeded"}
    assert headers_named(text) == {"x-priority", "retry-after", "retry-after-ms"}
    assert metrics_named(text) == {"kvgate_gateway_requests_total", "kvgate_scheduler_zone"}


def test_the_code_side_finds_every_kind_of_definition() -> None:
    # A keyword literal, a constant, the f-string's expansion and the status table.
    assert {"exceeds_burst", "capacity_exceeded", "rate_limit_exceeded", "upstream_unreachable",
            "upstream_error", "request_too_large", "not_found"} <= CODES
    assert "zone_red" not in CODES  # a rejection reason (a metric label), never sent as a code
    assert {"x-request-timeout", "retry-after", "retry-after-ms", "x-should-retry"} <= (
        GATEWAY_HEADERS)
    assert "kvgate_gateway_requests_total" in EXPORTED


def test_the_docs_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/architecture.md", "docs/runbook.md",
            "clients/python/README.md"} <= names
    named = set().union(*(error_codes_named(doc_text(p)) for p in DOCS))
    assert len(named) >= 10, named


# --- the docs against the code ----------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_error_code_the_docs_name_is_sent_by_the_gateway(doc: Path) -> None:
    unknown = sorted(error_codes_named(doc_text(doc)) - CODES)
    assert not unknown, f"{doc.name} names error codes the gateway never sends: {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_header_the_docs_name_is_one_the_code_uses(doc: Path) -> None:
    # The SDK's README may also name the headers the SDK itself sends.
    known = GATEWAY_HEADERS | (CLIENT_HEADERS if doc.is_relative_to(ROOT / "clients") else set())
    unknown = sorted(headers_named(doc_text(doc)) - known)
    assert not unknown, f"{doc.name} names headers the code never uses: {unknown}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_metric_the_docs_name_is_exported(doc: Path) -> None:
    unknown = sorted(metrics_named(doc_text(doc)) - set(EXPORTED))
    assert not unknown, f"{doc.name} names metrics no registry exports: {unknown}"
