"""dominospec: train, export, serve and measure Domino speculative-decoding drafts."""

__version__ = "0.1.0"
