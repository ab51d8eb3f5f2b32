"""`python -m trainer [flags]`: the main job (see trainer/cli.py; `--help` lists the flags).

    python -m runtime.launch -n 4 -m trainer      # 4 ranks, ddp on digits
    python -m trainer                              # one process
"""

import sys

from trainer.cli import main

if __name__ == "__main__":
    sys.exit(main())
