"""DVC stage `serve_eval`: see dominospec.stages.STAGES['serve_eval']."""

import sys

from dominospec.stages import stage_main

if __name__ == "__main__":
    sys.exit(stage_main("serve_eval"))
