"""DVC stage `headline`: see dominospec.stages.STAGES['headline']."""

import sys

from dominospec.stages import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("headline"))
