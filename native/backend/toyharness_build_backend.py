"""The package's build backend: setuptools' own, asking pip for cmake, ninja and pip only where
the native build needs them (native/build.py, build_requirements).

pip installs a build's requirements into a fresh environment at every install; cmake's wheel
alone took most of an install that compiled nothing. Where the cache holds a current build of
these sources, or the machine has cmake and ninja, they are not installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every other hook is setuptools')

NATIVE_BUILD = Path(__file__).resolve().parents[1] / "build.py"


def _native_requirements() -> list[str]:
    spec = importlib.util.spec_from_file_location("toyharness_native_build", NATIVE_BUILD)
    native = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(native)
    requirements = native.build_requirements()
    native.log("native build requirements for pip: " + (", ".join(requirements) or "none"))
    return requirements


def get_requires_for_build_wheel(config_settings: dict | None = None) -> list[str]:
    return _setuptools.get_requires_for_build_wheel(config_settings) + _native_requirements()


def get_requires_for_build_editable(config_settings: dict | None = None) -> list[str]:
    return _setuptools.get_requires_for_build_editable(config_settings) + _native_requirements()
