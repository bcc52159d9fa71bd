"""Installs ``icestate_pyspark_path.pth`` at the root of site-packages with the packages: at
every interpreter's start it makes Spark's Python processes import the installed pyspark
instead of its zipped copy (``icestate_pyspark_path``). Everything else is in pyproject.toml.
An editable install (``pip install -e``) does not install it; scripts/setup.sh copies it."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "icestate_pyspark_path.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
