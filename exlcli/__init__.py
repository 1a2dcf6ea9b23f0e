"""exlcli: a fast local LLM engine with a terminal front end."""

import os

# Large CPU tensors (a model's repacked weights, its KV cache) on huge pages: torch reads this once, at its
# first allocation, so it is set before anything imports torch. Each 4 KiB page of a fresh allocation is
# otherwise a fault of its own, which on a VM costs about as much as building the weights' layout.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
