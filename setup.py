"""Installs both top-level packages, ``curvature`` and ``torchsso2``."""
from setuptools import find_packages, setup

setup(
    name="torchsso2",
    version="0.1.0",
    description="Second-order optimization for PyTorch: curvature engine, natural-gradient and VI optimizers, KAISA K-FAC",
    packages=find_packages(include=["curvature", "curvature.*", "torchsso2", "torchsso2.*"]),
    python_requires=">=3.9",
    install_requires=["torch>=2.0", "numpy"],
    extras_require={
        "mpi": ["mpi4py"],
        "cupy": ["cupy-cuda12x"],
        "plot": ["matplotlib"],
        "examples": ["scikit-learn", "tqdm", "matplotlib"],
        "test": ["pytest", "hypothesis", "scikit-learn", "tqdm", "matplotlib", "mpich", "mpi4py", "pytorch-lightning"],
        # ASDL is published as `asdfghjkl` (imported as `asdl`); PyPI's `asdl` is an unrelated grammar parser
        "bench": ["scikit-learn", "tqdm", "matplotlib", "backpack-for-pytorch",
                  "curvlinops-for-pytorch", "ivon-opt", "laplace-torch", "asdfghjkl"],
    },
)
