"""DVC stage `train`: see dominospec.stages.STAGES['train'] and docs/design.md §3."""

import sys

from dominospec.stages import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("train"))
