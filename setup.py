"""malleus_ds: straggler-resilient hybrid-parallel training on DeepSpeed."""
from setuptools import find_packages, setup

setup(
    name="malleus_ds",
    version="0.1.0",
    description="Straggler-resilient non-uniform hybrid parallelism (Malleus) on DeepSpeed",
    python_requires=">=3.10",
    # The Triton kernels live in the repository's top-level kernels/ folder and install as the
    # package ``malleus_ds_kernels``: a folder named ``kernels`` on sys.path (the repo root, the
    # CWD) must never shadow Hugging Face's hub-kernels package ``kernels``, which newer
    # transformers import. kernels/ has no __init__.py, so it is at most a namespace portion there.
    packages=find_packages(include=["malleus_ds", "malleus_ds.*"]) + ["malleus_ds_kernels"],
    package_dir={"malleus_ds_kernels": "kernels"},
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
        # Hugging Face models (malleus_ds/models/hf.py); tests/integration/test_transformers_import.py
        # checks them beside HF's ``kernels`` package
        "transformers>=4.57,<6",
        "safetensors>=0.4",
    ],
    extras_require={
        # HF's hub-kernels package (``kernels``): newer transformers require it, so the suite
        # always runs with it present and a name clash with our kernels cannot come back unseen
        # (pytest-xdist: scripts/test.sh spreads tests/unit over the cores)
        "dev": ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "hypothesis>=6.100",
                "kernels>=0.4", "pyarrow>=14", "accelerate>=1.16,<2"],
        # malleus_ds.hf.MalleusTrainer: the Hugging Face Trainer under DeepSpeed builds its engine
        # and dataloader through accelerate (tests/integration/test_hf_trainer.py, with the
        # versions in constraints-cpu.txt)
        "hf": ["transformers>=5.18,<6", "accelerate>=1.16,<2"],
        # data=text from .parquet files and datasets save_to_disk folders (malleus_ds/data/
        # text_files.py); .jsonl and .txt need nothing extra
        "text": ["pyarrow>=14"],
    },
    entry_points={
        "console_scripts": [
            "malleus-plan=malleus_ds.app.cli:plan_main",
            "malleus-sim=malleus_ds.app.cli:sim_main",
            "malleus-plot=malleus_ds.report.plot:main",
            "malleus-export=malleus_ds.app.cli:export_main",
            "malleus-chaos=malleus_ds.chaos.cli:main",
        ],
    },
)
