"""DVC stage `export`: see dominospec.stages.STAGES['export'] and docs/design.md §3, §5."""

import sys

from dominospec.stages import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("export"))
