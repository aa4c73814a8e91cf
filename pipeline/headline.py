"""DVC stage `headline`: see dominospec.cli.STAGES['headline']."""

import sys

from dominospec.stages import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("headline"))
