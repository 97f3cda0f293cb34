from setuptools import find_packages, setup

setup(
    name="spec-nmt",
    version="0.1.0",
    description="Speculative decoding (Spec-Drafter + SpecDec verification) as a fairseq plugin",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["spec_nmt", "spec_nmt.*"]),
    python_requires=">=3.9",
    install_requires=[
        "torch>=2.0",
        'fairseq==0.12.2; python_version < "3.11"',
        've-fairseq==0.12.3; python_version >= "3.11" and python_version < "3.13"',
        "sacrebleu>=2.0",
        "sentencepiece>=0.1.99",
    ],
    extras_require={"test": ["pytest>=7", "scipy>=1.10"]},
    license="MIT",
)
