"""DVC stage `card`: see dominospec.stages.STAGES['card']."""

import sys

from dominospec.stages import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("card"))
