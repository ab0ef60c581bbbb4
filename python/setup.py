"""Builds the package with its gRPC modules generated from ../proto at build
time (generate_protos.py); the metadata is in pyproject.toml.

  pip install --no-build-isolation ./python
"""

import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import generate_protos  # noqa: E402


class BuildPyWithProtos(build_py):

    def run(self) -> None:
        super().run()
        generate_protos.generate(self.build_lib)


setup(cmdclass={"build_py": BuildPyWithProtos})
