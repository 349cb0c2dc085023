import importlib.metadata

from ._cosine import cosine_sim_flash_attention as cosine_sim_flash_attention
from ._flash import causal_flash_attention as causal_flash_attention
from ._flash import flash_attention as flash_attention
from ._reference import plain_attention as plain_attention
from ._sanity import value_and_grad_difference as value_and_grad_difference

__version__ = importlib.metadata.version("eqx_flash")
