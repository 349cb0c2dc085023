import importlib.metadata

from ._block_mask import BlockMask as BlockMask
from ._block_mask import make_block_mask as make_block_mask
from ._cache import KVCache as KVCache
from ._cache import rotary as rotary
from ._cosine import cosine_sim_flash_attention as cosine_sim_flash_attention
from ._flash import causal_flash_attention as causal_flash_attention
from ._flash import flash_attention as flash_attention
from ._modules import FlashAttention as FlashAttention
from ._modules import FlashMultiheadAttention as FlashMultiheadAttention
from ._position_bias import ALiBi as ALiBi
from ._position_bias import RelativePositionBias as RelativePositionBias
from ._reference import plain_attention as plain_attention
from ._ring import ring_flash_attention as ring_flash_attention
from ._sanity import value_and_grad_difference as value_and_grad_difference
from ._sequence_order import from_ring_layout as from_ring_layout
from ._sequence_order import ring_order as ring_order
from ._sequence_order import to_ring_layout as to_ring_layout
from ._sharded import sharded_flash_attention as sharded_flash_attention

__version__ = importlib.metadata.version("eqx_flash")
