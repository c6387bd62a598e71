"""Predicates the argument and file checks share."""
from __future__ import annotations

from numbers import Integral

import numpy as np


def is_int(value: object) -> bool:
    """A whole number (Python's or numpy's), not a bool: True is neither a count, an id nor a size."""
    return type(value) is int or (isinstance(value, Integral) and not isinstance(value, (bool, np.bool_)))
