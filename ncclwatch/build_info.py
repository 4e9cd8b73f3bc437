"""What every ncclwatch service exports about itself: ``ncclwatch_build_info`` and the
process metrics (CPU, memory, open files, start time) of prometheus_client's collectors.

Services keep private registries (never the global one, so tests and two pipelines in
one process do not collide), and a private registry has none of the default collectors:
:func:`register` adds them.

>>> from prometheus_client import CollectorRegistry
>>> reg = CollectorRegistry()
>>> register(reg, "watch")
>>> reg.get_sample_value("ncclwatch_build_info", {"version": version(), "contract": "1",
...     "component": "watch", "python": platform.python_version()})
1.0
>>> reg.get_sample_value("process_cpu_seconds_total") is not None  # on Linux
True
"""

from __future__ import annotations

import importlib.metadata
import platform

from prometheus_client import CollectorRegistry, Info, PlatformCollector, ProcessCollector

from ncclwatch.records import VERSION as CONTRACT_VERSION


def version() -> str:
    try:
        return importlib.metadata.version("ncclwatch")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "unknown"


def register(registry: CollectorRegistry, component: str) -> None:
    """Add ``ncclwatch_build_info{version, contract, component, python}`` and the process
    and platform collectors to ``registry``."""
    Info("ncclwatch_build", "The running ncclwatch: package version, record contract version, "
         "component, Python version", registry=registry).info(
        {"version": version(), "contract": str(CONTRACT_VERSION), "component": component,
         "python": platform.python_version()})
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
