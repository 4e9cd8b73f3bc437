"""Puts the NCCL profiler plugin into the wheel; all other metadata is in pyproject.toml.

On Linux x86-64 with make and a C compiler, ``build_py`` runs ``make -C plugin`` and copies
``libncclwatch-profiler.so`` to ``ncclwatch/lib/``, where ``ncclwatch plugin-path`` finds
it. The .so holds no Python code, so the wheel is ``py3-none-<platform>``: one wheel for
every Python 3.11+, tagged with the oldest glibc the .so asks for (``manylinux_2_34`` when
built on glibc 2.34 or newer; build in an older manylinux image for older systems).
Elsewhere, or with ``NCCLWATCH_BUILD_PLUGIN=0``, the wheel is pure Python. Editable
installs never build it: a checkout uses ``plugin/build/`` (``make -C plugin``).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:  # setuptools >= 70.1 carries bdist_wheel; before that it lived in `wheel`
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
PLUGIN_SO = "libncclwatch-profiler.so"
PLUGIN_DEST = os.path.join("ncclwatch", "lib", PLUGIN_SO)


def want_plugin() -> bool:
    if os.environ.get("NCCLWATCH_BUILD_PLUGIN", "1") == "0":
        return False
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    return os.path.exists(os.path.join(HERE, "plugin", "Makefile")) and shutil.which("make") is not None


def glibc_tag(so_path: str) -> str:
    """manylinux tag for the newest GLIBC_x.y symbol version the .so needs (at least 2.17).

    The version names sit in the dynamic string table as plain text, so no ELF parser is
    needed; the plugin links only libc, libdl, libm and libpthread, which manylinux allows.
    """
    with open(so_path, "rb") as f:
        data = f.read()
    versions = {(int(a), int(b)) for a, b in re.findall(rb"GLIBC_(\d+)\.(\d+)", data)}
    major, minor = max(versions | {(2, 17)})
    return f"manylinux_{major}_{minor}_x86_64"


class BuildPyWithPlugin(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or not want_plugin():
            return
        subprocess.run(["make", "-s", "-C", os.path.join(HERE, "plugin")], check=True)
        dest = os.path.join(self.build_lib, PLUGIN_DEST)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        shutil.copy2(os.path.join(HERE, "plugin", "build", PLUGIN_SO), dest)


class PluginDistribution(Distribution):
    # Platform files go to platlib, the wheel's root (Root-Is-Purelib: false).
    def has_ext_modules(self):
        return want_plugin()


class PlatformWheel(bdist_wheel):
    def get_tag(self):
        so = os.path.join(self.bdist_dir, PLUGIN_DEST)
        if not self.root_is_pure and os.path.exists(so):
            return "py3", "none", glibc_tag(so)
        return super().get_tag()


setup(
    distclass=PluginDistribution,
    cmdclass={"build_py": BuildPyWithPlugin, "bdist_wheel": PlatformWheel},
)
