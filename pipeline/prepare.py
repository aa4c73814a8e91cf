"""DVC stage `prepare`: see dominospec.cli.STAGES['prepare'] and DESIGN.md §3."""

import sys

from dominospec.stages import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("prepare"))
