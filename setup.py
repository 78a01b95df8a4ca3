from setuptools import find_packages, setup

HF = ["transformers>=5.24", "tokenizers>=0.23.1", "safetensors>=0.8", "accelerate>=1.1"]

setup(
    name="linformer-fairseq",
    version="0.1.0",
    description="Linformer (Wang et al. 2020) as a fairseq plugin for RoBERTa-style pretraining",
    # the plugin, and the helpers of the data-prep stages, the scripts and the tests
    packages=[*find_packages(include=["linformer_fairseq", "linformer_fairseq.*"]), "dataprep", "linformer_tools"],
    package_dir={"dataprep": "data-prep/dataprep", "linformer_tools": "scripts/linformer_tools"},
    python_requires=">=3.10",  # torch 2.13 (README: Install) has wheels for 3.10 and up
    install_requires=[
        # fairseq-fixed is fairseq's main branch, installable on every Python we claim; it provides
        # the same `fairseq` module. fairseq 0.12.2 no longer installs with pip >= 24.1 (its
        # omegaconf<2.1 has metadata pip rejects) and does not import on Python >= 3.11.
        "fairseq-fixed>=0.12.3",
        "sentencepiece",
        "tensorboard",
        "wikiextractor>=3.1.0",  # data-prep; 3.0.x fails on Python 3.11
    ],
    extras_require={
        # scripts/export_hf.py and the models it writes (accelerate: transformers' Trainer); the
        # plugin itself never imports them
        "hf": HF,
        "dev": ["pytest", "pytest-xdist", "matplotlib", "ruff", *HF],
    },
)
