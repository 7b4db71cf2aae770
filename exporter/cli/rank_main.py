"""One rank of `b12x run --nproc`, started by torchrun: the launcher's command line, run as this rank."""

from __future__ import annotations

import json
import os

from b12x_toolchain.exporter.cli.main import main
from b12x_toolchain.exporter.cli.ranks import ARGS

if __name__ == "__main__":
    main(json.loads(os.environ[ARGS]))
