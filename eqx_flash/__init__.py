import importlib.metadata

from ._api.cosine import cosine_sim_flash_attention as cosine_sim_flash_attention
from ._api.flash import causal_flash_attention as causal_flash_attention
from ._api.flash import flash_attention as flash_attention
from ._api.kernel_choice import kernel_family as kernel_family
from ._api.merge import merge_attention as merge_attention
from ._api.reference import plain_attention as plain_attention
from ._api.sanity import value_and_grad_difference as value_and_grad_difference
from ._distributed.ring import ring_flash_attention as ring_flash_attention
from ._distributed.sequence_order import from_ring_layout as from_ring_layout
from ._distributed.sequence_order import ring_order as ring_order
from ._distributed.sequence_order import to_ring_layout as to_ring_layout
from ._distributed.sharded import sharded_flash_attention as sharded_flash_attention
from ._frontends.flash_attn import flash_attn_func as flash_attn_func
from ._frontends.flash_attn import flash_attn_varlen_func as flash_attn_varlen_func
from ._frontends.flax_attention import flax_attention as flax_attention
from ._frontends.jax_nn import dot_product_attention as dot_product_attention
from ._mods.block_mask import BlockMask as BlockMask
from ._mods.block_mask import make_block_mask as make_block_mask
from ._mods.position_bias import ALiBi as ALiBi
from ._mods.position_bias import RelativePositionBias as RelativePositionBias
from ._mods.position_bias import RelativeScoreMod as RelativeScoreMod
from ._nn.attention import FlashAttention as FlashAttention
from ._nn.cache import KVCache as KVCache
from ._nn.multihead import FlashMultiheadAttention as FlashMultiheadAttention
from ._nn.rotary import rotary as rotary

__version__ = importlib.metadata.version("eqx_flash")
