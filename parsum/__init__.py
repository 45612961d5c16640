"""parsum: parallel, compensated and deterministic sums of PyTorch models."""

from . import _allocator, distributed
from ._api import sum_models
from ._config import config
from ._errors import ParsumError
from ._function import ParallelSum
from ._fused import StepInBackward
from ._grads import FlatGrad
from ._module import SumOfModels
from ._sparse import take_rows
from ._stack import Stack, stack_
from ._summation import compensated_sum

__version__ = "0.1.0"

_allocator.keep_heap_top()  # NOTE [ glibc's heap top ]

__all__ = [
    # the normal door
    "sum_models",
    "SumOfModels",
    "config",
    "FlatGrad",
    "StepInBackward",
    "take_rows",
    "stack_",
    "Stack",
    # lower level
    "ParallelSum",
    "compensated_sum",
    # across processes
    "distributed",
    # errors
    "ParsumError",
]
