"""Model definitions (HF style): the Domino draft, and the target's lean forward. Imports torch, transformers and dominospec.kernels only."""
