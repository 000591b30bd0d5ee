"""Install megatron_fcp.

torch is pinned in the README's install command (``pip install torch==2.13.0 ...``) so that a fresh
CPU machine takes the CPU wheel; here it is only a lower bound, so GPU users keep their CUDA build.
megatron-core 0.16.x is what pip resolves on Python 3.11 (0.17+ need Python 3.12).
Never put transformer-engine in the default requirements: on CPU its build pulls a CUDA torch.
"""
from setuptools import find_packages, setup

setup(
    name="megatron_fcp",
    version="0.1.0",
    description="Flexible Context Parallelism (graph-scheduled CP attention) for Megatron-LM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_fcp", "megatron_fcp.*"]),
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.14,<0.20",  # every minor release here passes tests/compat/run_matrix.sh
        "networkx>=3.0",
        "PyYAML>=6.0",
        "einops>=0.7",
        "tqdm>=4.0",
        "numpy>=1.24",
        # compiles the planner's per-batch loops (megatron_fcp/jit.py); without it they run as Python
        "numba>=0.60",
    ],
    extras_require={
        "plot": ["matplotlib>=3.7"],
        "test": ["pytest>=7.4", "hypothesis>=6.80", "matplotlib>=3.7"],
        # GPU-only kernels; never installed by the CPU commands in README.md.
        "gpu": ["transformer-engine[pytorch]>=1.12"],
    },
    entry_points={"console_scripts": ["megatron-fcp=megatron_fcp.cli:main"]},
)
