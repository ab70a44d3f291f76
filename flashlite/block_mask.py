"""Block tables: a face; the code lives in :mod:`flashlite.masking.block_mask`, ``.classify``."""

from flashlite.masking import EMPTY, FULL, PARTIAL, BlockMask, cdiv, tables, torch_classify

__all__ = ["EMPTY", "PARTIAL", "FULL", "BlockMask", "tables", "torch_classify", "cdiv"]
