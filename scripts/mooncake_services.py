#!/usr/bin/env python3
"""Start / stop a local Mooncake cluster (master, metadata server, store service) on 127.0.0.1.

    python scripts/mooncake_services.py start [--workdir DIR] [--metadata http|master|p2p] [--segment-size 256mb]
    python scripts/mooncake_services.py status|stop [--workdir DIR]

`start` prints `export MOONCAKE_...=...` lines to point kvstrata (or SGLang) at the cluster; its PIDs are
kept in DIR/cluster.json and `stop` kills their process groups. See kvstrata/storage/mooncake_services.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstrata.storage.mooncake_services import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
