"""HBM traffic of one attention or softmax call: modelled, counted, measured.

The module moved to ``flashlite/traffic/count.py`` unchanged (so its history follows); the next
commit splits it into the package's modules. Every name, private ones included, is forwarded.
"""

from typing import Any

from flashlite.traffic import count as _count

__all__ = _count.__all__


def __getattr__(name: str) -> Any:
    return getattr(_count, name)
