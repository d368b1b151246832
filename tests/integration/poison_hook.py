"""Test-only fault injection for `firsttoken worker` subprocesses: every engine step that computes
a job listed in FIRSTTOKEN_TEST_POISON_IDS raises, as a kernel or sampler bug would for an input.

Run as `python -m poison_hook worker` (tests/integration on sys.path); the engine must run in the
worker's process (FIRSTTOKEN_ENGINE_PROCESS=0), where the patch applies.
"""

from __future__ import annotations

import os
import sys

from workers.engine.model_runner import ModelRunner

POISON = frozenset(filter(None, os.environ.get("FIRSTTOKEN_TEST_POISON_IDS", "").split(",")))
_execute = ModelRunner.execute


def _poisoned_execute(self, out, prev=None, guide=None):  # type: ignore[no-untyped-def]
    if any(e.request.request_id in POISON for e in out.scheduled):
        raise ValueError("Overflow when unpacking long long")  # what a top_k of 1e30 once raised
    return _execute(self, out, prev, guide)


ModelRunner.execute = _poisoned_execute  # type: ignore[method-assign]

if __name__ == "__main__":
    from firsttoken.cli import main

    sys.exit(main(sys.argv[1:]))
