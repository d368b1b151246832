"""Suite-wide settings.

CPU runs use Triton's interpreter, selected before anything imports triton: transformers may
import it, and a triton imported without the flag cannot interpret later. On a GPU machine set
FIRSTTOKEN_GPU_TESTS=1 to compile the kernels for the device instead.
"""

from __future__ import annotations

import os

if os.environ.get("FIRSTTOKEN_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
