"""Installs both top-level packages, ``curvature`` and ``torchsso2``."""
from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="torchsso2",
    version="0.1.0",
    description="Second-order optimization for PyTorch: curvature engine, natural-gradient and VI optimizers, KAISA K-FAC",
    long_description=(Path(__file__).parent / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["curvature", "curvature.*", "torchsso2", "torchsso2.*"]),
    # PEP 561: the packages' type hints are visible to the users' type checkers
    package_data={"curvature": ["py.typed"], "torchsso2": ["py.typed"]},
    python_requires=">=3.9",
    # torch 2.4 added what the optimizers use at every step (torch.OutOfMemoryError, is_autocast_enabled(device),
    # the CPU fused SGD kernel) and deep copies of a torch.Generator; torch 2.4's dynamo fails on a compiled
    # forward with the curvature hooks. The test suite passes on 2.5.1 (Python 3.9); CI runs 2.13
    install_requires=["torch>=2.5", "numpy"],
    extras_require={
        # mpi4py needs an MPI library: the mpich wheel provides one (and mpiexec) without system packages
        "mpi": ["mpi4py", "mpich"],
        "cupy": ["cupy-cuda12x"],
        "plot": ["matplotlib"],
        "examples": ["scikit-learn", "tqdm", "matplotlib"],
        "test": ["pytest", "hypothesis", "scikit-learn", "tqdm", "matplotlib", "mpich", "mpi4py", "pytorch-lightning",
                 "mypy"],
        # ASDL is published as `asdfghjkl` (imported as `asdl`); PyPI's `asdl` is an unrelated grammar parser
        "bench": ["scikit-learn", "tqdm", "matplotlib", "backpack-for-pytorch",
                  "curvlinops-for-pytorch", "ivon-opt", "laplace-torch", "asdfghjkl"],
    },
)
