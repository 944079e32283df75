"""kvplug: a KV-cache-aware router for LLM serving with a C hot path.

``kvplug.backend`` names the active core ("c" or "reference"); see kvplug.core.
Importing kvplug stays light: no networking modules are imported here.
"""

from kvplug.core import backend

__version__ = "0.1.0"

__all__ = ["__version__", "backend"]
