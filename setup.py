"""Install hook: build the native libraries (native/build.py) into toyharness/_native.

A placeholder Extension makes setuptools run build_ext for both `pip install .` and
`pip install -e .`; our build_ext runs CMake instead of compiling sources itself.
"""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class NativeBuild(build_ext):
    def run(self):
        spec = importlib.util.spec_from_file_location("toyharness_native_build", ROOT / "native" / "build.py")
        native = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native)
        try:
            bdir = native.build()
            for ext in self.extensions:
                out = Path(self.get_ext_fullpath(ext.name)).parent
                native.install_into(out, bdir)
        except native.BuildError as exc:
            raise SystemExit(f"toyharness native build failed: {exc}") from exc

    def get_outputs(self):
        out = Path(self.get_ext_fullpath(self.extensions[0].name)).parent
        return [str(p) for p in out.glob("lib*.so*")]


setup(
    ext_modules=[Extension("toyharness._native.libs", sources=[])],
    cmdclass={"build_ext": NativeBuild},
)
