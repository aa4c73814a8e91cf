"""DVC stage `evaluate`: see dominospec.stages.STAGES['evaluate'] and docs/design.md §3."""

import sys

from dominospec.stages import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("evaluate"))
