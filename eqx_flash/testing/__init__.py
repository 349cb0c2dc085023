"""Test utilities for attention code: Hypothesis strategies and an exactness checker.

```python
from hypothesis import given
from eqx_flash.testing import attention_inputs, check_attention

@given(attention_inputs(causal=False))
def test_my_attention(inputs):
    check_attention(my_attention, inputs)
```

`attention_inputs` needs the optional dependency `hypothesis` (`pip install
eqx_flash[testing]`); it is imported when the strategy is built, so `import eqx_flash` and
`check_attention` never need it.
"""

from .._api.sanity import value_and_grad_difference as value_and_grad_difference
from ._checker import check_attention as check_attention
from ._families import BlockSparse as BlockSparse
from ._families import Dilated as Dilated
from ._families import Documents as Documents
from ._families import HeadScaling as HeadScaling
from ._families import PrefixLM as PrefixLM
from ._families import RelativeBiasTable as RelativeBiasTable
from ._strategies import AttentionInputs as AttentionInputs
from ._strategies import attention_inputs as attention_inputs
from ._tolerances import PRECISION as PRECISION
from ._tolerances import TOLERANCES as TOLERANCES
from ._tolerances import Tolerance as Tolerance
from ._tolerances import tolerance_for as tolerance_for

__all__ = [
    "AttentionInputs",
    "BlockSparse",
    "Dilated",
    "Documents",
    "HeadScaling",
    "PRECISION",
    "PrefixLM",
    "RelativeBiasTable",
    "Tolerance",
    "TOLERANCES",
    "attention_inputs",
    "check_attention",
    "tolerance_for",
    "value_and_grad_difference",
]
