"""DVC stage `regenerate`: see dominospec.stages.STAGES['regenerate'] and docs/design.md §3."""

import sys

from dominospec.stages import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("regenerate"))
