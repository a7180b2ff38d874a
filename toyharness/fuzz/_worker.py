"""The fuzz worker's entry point: `python -m toyharness.fuzz._worker PLAN_JSON` (harness.worker)."""

import json
import sys

from .harness import worker

worker(json.loads(sys.argv[1]))
