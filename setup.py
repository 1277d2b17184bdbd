"""The project is configured in pyproject.toml; this adds one file to what pip installs:
`mlx_dsv41_cache_hook.pth` in site-packages, so that mlx-lm programs can read our prompt-cache
files (mlx_dsv41_cache_hook.py says why). Regular and editable (`pip install -e`) installs."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "mlx_dsv41_cache_hook.pth"
PTH_LINE = "import mlx_dsv41_cache_hook; mlx_dsv41_cache_hook.install()\n"


class BuildPy(build_py):
    def run(self):
        super().run()
        Path(self.build_lib, PTH_NAME).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode=1):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, PTH_NAME))]


class EditableWheel(editable_wheel):
    """An editable wheel holds no build_lib files, only setuptools' own .pth: add ours."""

    def run(self):
        super().run()
        from wheel.wheelfile import WheelFile

        for wheel in Path(self.dist_dir).glob("*.whl"):
            with WheelFile(wheel, "a") as archive:
                archive.writestr(PTH_NAME, PTH_LINE)


setup(cmdclass={"build_py": BuildPy, "editable_wheel": EditableWheel})
