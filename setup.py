"""malleus_ds: straggler-resilient hybrid-parallel training on DeepSpeed."""
from setuptools import find_packages, setup

setup(
    name="malleus_ds",
    version="0.1.0",
    description="Straggler-resilient non-uniform hybrid parallelism (Malleus) on DeepSpeed",
    python_requires=">=3.10",
    packages=find_packages(include=["malleus_ds", "malleus_ds.*", "kernels", "kernels.*"]),
    # the shipped byte corpus (nothing is downloaded at run time)
    package_data={"malleus_ds.data": ["corpus.txt"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.3",
        # The engine subclass touches DeepSpeed internals: stay on the minor series it was built on.
        "deepspeed~=0.19.8",
        "triton>=3.0",
        "pymoo~=0.6.2",
        "hydra-core~=1.3",
        "omegaconf~=2.3",
        "numpy>=1.24",
        "matplotlib>=3.7",
        "tqdm>=4.60",
        "tensorboard>=2.14",   # DeepSpeed's TensorBoard monitor (ds_config "tensorboard")
        # Hugging Face models (issue: bring your own model); our top-level ``kernels`` package
        # shares its name with HF's hub-kernels package: tests/unit/test_transformers_import.py
        "transformers>=4.57,<6",
        "safetensors>=0.4",
    ],
    extras_require={
        "dev": ["pytest>=8", "pytest-timeout>=2.2", "hypothesis>=6.100"],
    },
    entry_points={
        "console_scripts": [
            "malleus-plan=malleus_ds.cli:plan_main",
            "malleus-sim=malleus_ds.cli:sim_main",
            "malleus-plot=malleus_ds.plot:main",
            "malleus-export=malleus_ds.export:main",
        ],
    },
)
