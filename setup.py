"""Ship the op sources inside the package: everything else is declared in pyproject.toml.

``custom_ops/csrc`` sits beside the package in the source tree, where an editable install (or a
checkout on ``PYTHONPATH``) reads it in place. A wheel carries only packages, so the build copies
the sources into ``eplb_graph/ops/csrc``, the first place ``eplb_graph.ops.native`` looks. Keeping
``custom_ops`` out of the installed packages means no top-level name that another distribution
could also claim.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

OP_SOURCES = Path("custom_ops") / "csrc"
PACKAGED_SOURCES = Path("eplb_graph") / "ops" / "csrc"


class BuildPyWithOpSources(build_py):
    """``build_py`` that also copies the C++ op sources into the built package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # the editable package reads custom_ops/csrc in place
            return
        target = Path(self.build_lib) / PACKAGED_SOURCES
        self.mkpath(str(target))
        for source in sorted(OP_SOURCES.glob("*.cpp")):
            self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildPyWithOpSources})
