"""Draft model definitions (HF style). Imports torch, transformers and dominospec.kernels only."""
