"""DVC stage `export`: see dominospec.cli.STAGES['export'] and DESIGN.md §3, §5."""

import sys

from dominospec.stages import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("export"))
