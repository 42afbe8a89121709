"""python3 -m chv_guest.metrics: chv-fleet-metrics (collector.main)."""

from __future__ import annotations

import sys

from .collector import main

sys.exit(main())
