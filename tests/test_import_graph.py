"""Imports run downhill: contract → sources, detector library and sinks → runners.

The package-dir mapping (``ncclwatch.detectors`` lives in ``detectors/``) hides these
edges from tools, and an import inside a function is still a dependency: this test reads
every import of the shipped modules and of the test kit (``ncclwatch_testkit``, in
``testkit/``), at any depth, from the source, and fails on an upward import, an import
across sibling components, product code importing test support, or a cycle. ``LAYERS`` is
the whole design, in one table; docs/architecture.md draws it. The test kit is the
support layer, outside the product: it may import the product, never the other way, and
the wheel carries none of it.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
# What the wheel ships, folder -> package, as pyproject.toml maps it (deploy/ is data only).
PACKAGE_DIRS = {folder: package for package, folder in SETUPTOOLS["package-dir"].items()}
# The test kit: its own distribution (testkit/pyproject.toml), never in the wheel.
TESTKIT = "ncclwatch_testkit"
SUPPORT_DIRS = {f"testkit/{TESTKIT}": TESTKIT}
# The modules that were test support inside the package before the kit took them.
FORMER_SUPPORT = ("ncclwatch/testing.py", "detectors/scenarios.py", "ingest/synth.py", "dashboards/demo.py")

CONTRACT, LIBRARY, RUNNER, SUPPORT = 0, 1, 2, 3
# Modules not named here take their component's default (below).
LAYERS: dict[str, int] = {
    # the contract: records, routing rules, configuration and the small shared helpers
    "ncclwatch.records": CONTRACT, "ncclwatch.rules": CONTRACT, "ncclwatch.config": CONTRACT,
    "ncclwatch.redact": CONTRACT, "ncclwatch.private": CONTRACT, "ncclwatch.progress": CONTRACT,
    # runners: the commands, the Faust app, the local mode, replay and evaluation
    "ncclwatch": RUNNER,  # the package's training-process API (report_throughput)
    "ncclwatch.cli": RUNNER, "ncclwatch.config_cmd": RUNNER, "ncclwatch.plugin_cmd": RUNNER,
    "ncclwatch.exposition": RUNNER,  # the one metrics server of forward, worker and watch
    "ncclwatch.ingest.forward": RUNNER,
    "ncclwatch.detectors.watch": RUNNER, "ncclwatch.detectors.faust_app": RUNNER,
    "ncclwatch.detectors.faust_transport": RUNNER,
    "ncclwatch.detectors.replay": RUNNER, "ncclwatch.detectors.stream": RUNNER,
    "ncclwatch.detectors.messages": RUNNER, "ncclwatch.detectors.playback": RUNNER,
    "ncclwatch.detectors.console": RUNNER, "ncclwatch.detectors.saved": RUNNER,
    "ncclwatch.detectors.drain": RUNNER, "ncclwatch.detectors.evaluate": RUNNER,
    "ncclwatch.dashboards.report": RUNNER, "ncclwatch.alerting.alert_test": RUNNER,
    "ncclwatch.alerting.prom_rules": RUNNER,
    # support: the test kit (test services, labelled scenarios, synthetic spools, the demo
    # recording), outside the product; every ncclwatch_testkit module is in this layer
    "ncclwatch_testkit": SUPPORT, "ncclwatch_testkit.services": SUPPORT,
    "ncclwatch_testkit.scenarios": SUPPORT, "ncclwatch_testkit.synth": SUPPORT,
    "ncclwatch_testkit.demo": SUPPORT, "ncclwatch_testkit.drivers": SUPPORT,
}
# Library components may use the contract and their own modules; sinks may also read the
# detector library's results (e.g. the report's per-rank relative exec time).
MAY_USE = {"ingest": {"ingest"}, "detectors": {"detectors"}, "alerting": {"alerting"},
           "dashboards": {"dashboards", "detectors"}}


def component(module: str) -> str:
    parts = module.split(".")
    if parts[0] == TESTKIT:
        return "support"
    return parts[1] if len(parts) > 2 and parts[1] in MAY_USE else "ncclwatch"


def layer(module: str) -> int:
    if component(module) == "support":
        return SUPPORT
    return LAYERS.get(module, CONTRACT if component(module) == "ncclwatch" else LIBRARY)


def modules_in(dirs: dict[str, str]) -> dict[str, Path]:
    out = {}
    for folder, package in dirs.items():
        for path in sorted((REPO / folder).glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def shipped_modules() -> dict[str, Path]:
    return modules_in(PACKAGE_DIRS)


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that ``path`` imports, at any depth (function bodies and
    ``TYPE_CHECKING`` blocks included: both are dependencies)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                if name in modules:
                    found.add(name)
                elif node.module in modules:
                    found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
    return found


SHIPPED = shipped_modules()
MODULES = SHIPPED | modules_in(SUPPORT_DIRS)
GRAPH = {m: imports_of(p, MODULES) - {m} for m, p in MODULES.items()}


def why_not(src: str, dst: str) -> str:
    """Empty when ``src`` may import ``dst``, else the rule it breaks."""
    ls, ld = layer(src), layer(dst)
    if ld == SUPPORT and ls != SUPPORT:
        return "product code imports test support"
    if ls in (SUPPORT, RUNNER):
        return ""
    if ld > ls:
        return "upward import"
    if ls == LIBRARY and ld == LIBRARY and component(dst) not in MAY_USE[component(src)]:
        return "import across library components"
    return ""


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_scan_sees_the_package():
    assert {"ncclwatch.records", "ncclwatch.detectors.pipeline", "ncclwatch.ingest.forward"} <= set(SHIPPED)
    assert "ncclwatch.records" in GRAPH["ncclwatch.detectors.pipeline"]
    # an import inside a function body counts
    assert "ncclwatch.ingest.throughput" in GRAPH["ncclwatch"]
    # the test kit is scanned too, and its imports of the product are seen
    assert {"ncclwatch_testkit.services", "ncclwatch_testkit.scenarios"} <= set(MODULES)
    assert "ncclwatch.detectors.labels" in GRAPH["ncclwatch_testkit.scenarios"]


def test_every_named_module_exists():
    assert set(LAYERS) <= set(MODULES), set(LAYERS) - set(MODULES)


def test_support_is_outside_the_product():
    # every test kit module is support, and nothing the wheel ships is
    assert {m for m in MODULES if layer(m) == SUPPORT} == set(MODULES) - set(SHIPPED) != set()
    assert all(m.split(".")[0] == "ncclwatch" for m in SHIPPED)


def test_the_wheel_ships_no_test_support():
    packages = SETUPTOOLS["packages"]
    assert not [p for p in packages if p.split(".")[0] == TESTKIT], packages
    assert set(packages) == set(SETUPTOOLS["package-dir"]), "every package maps to its folder"
    assert not [d for d in SETUPTOOLS["package-dir"].values() if d.split("/")[0] == "testkit"]
    assert [f for f in FORMER_SUPPORT if (REPO / f).exists()] == []
    # the kit is its own distribution, holding just its package
    kit = tomllib.loads((REPO / "testkit" / "pyproject.toml").read_text())
    assert kit["project"]["name"] == "ncclwatch-testkit"
    assert kit["tool"]["setuptools"]["packages"] == [TESTKIT]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_downhill(module):
    bad = {dst: why for dst in sorted(GRAPH[module]) if (why := why_not(module, dst))}
    assert not bad, f"{module}: {bad}"


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_the_rules_can_fail():
    assert why_not("ncclwatch.records", "ncclwatch.detectors.pipeline") == "upward import"
    assert why_not("ncclwatch.detectors.pipeline", "ncclwatch.ingest.windows") == \
        "import across library components"
    assert why_not("ncclwatch.detectors.watch", "ncclwatch_testkit.services") == "product code imports test support"
    assert why_not("ncclwatch.records", "ncclwatch_testkit") == "product code imports test support"
    assert why_not("ncclwatch_testkit.scenarios", "ncclwatch.detectors.labels") == ""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


STREAM_CLIENTS = {"faust", "mode", "kafka", "aiokafka", "confluent_kafka"}


def third_party_roots(path: Path) -> set[str]:
    """Top-level packages ``path`` imports, at any depth."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
    return roots


def test_the_detector_library_imports_no_kafka_or_faust():
    # the Faust app and the local mode are thin drivers around a plain library
    library = [m for m in SHIPPED if layer(m) == LIBRARY and component(m) == "detectors"]
    assert "ncclwatch.detectors.pipeline" in library
    bad = {m: sorted(third_party_roots(SHIPPED[m]) & STREAM_CLIENTS) for m in library}
    assert {m: b for m, b in bad.items() if b} == {}
    assert third_party_roots(SHIPPED["ncclwatch.detectors.faust_transport"]) & STREAM_CLIENTS == {"faust"}
