from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

from spec_nmt_torch_load import PTH_LINE, PTH_NAME


class BuildWithPth(build_py):
    """Also put spec_nmt_torch_load.pth at the top of site-packages, so that stock fairseq tools
    in this environment load fairseq checkpoints with torch >= 2.6 (see spec_nmt_torch_load.py)."""

    def run(self):
        super().run()
        (Path(self.build_lib) / PTH_NAME).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH_NAME)]


def requirement_lines(name):
    """The requirement specifiers of a pip requirements file (comments dropped)."""
    lines = Path(__file__).with_name(name).read_text(encoding="utf-8").splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


setup(
    name="spec-nmt",
    version="0.1.0",
    description="Speculative decoding (Spec-Drafter + SpecDec verification) as a fairseq plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["spec_nmt", "spec_nmt.*"]),
    py_modules=["spec_nmt_torch_load"],
    cmdclass={"build_py": BuildWithPth},
    entry_points={"console_scripts": ["spec-nmt-translate = spec_nmt.cli:main"]},
    # fairseq installs below Python 3.13 only (fairseq 0.12.2 up to 3.10, its ve-fairseq build on
    # 3.11 and 3.12, the markers below); the project's own environment runs 3.11
    python_requires=">=3.9,<3.13",
    install_requires=[
        "torch>=2.1",  # (torch.backends.cpu.get_cpu_capability: the twin's batch limit)
        'fairseq==0.12.2; python_version < "3.11"',
        've-fairseq==0.12.3; python_version >= "3.11" and python_version < "3.13"',
        "sacrebleu>=2.0",
        "sentencepiece>=0.1.99",
        "sentence-splitter>=1.4",
        "tqdm>=4",
    ],
    extras_require={"test": requirement_lines("requirements-test.txt")},
    license="MIT",
)
