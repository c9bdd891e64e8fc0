"""Caches behind one interface (LRU, TTL, Redis, tiers of them), and KV blocks as cache values.

    from devin_compile.cache import CacheManager, LRUCache, TTLCache, RedisCache, TieredCache
    cm = CacheManager(TieredCache([LRUCache(max_bytes=2 << 30), RedisCache("redis://127.0.0.1:6379/0", ttl_s=3600)]))
    cm.set(key, value); cm.get(key); cm.invalidate(key); cm.clear(); cm.stats()

This package sits at the runtime's floor and imports nothing else of devin_compile, so the runtime
(the paged pool's prefix blocks) can plug it in below itself.
"""
from .base import CacheBackend, CacheStats, EvictCallback, Key
from .clock import SteadyClock
from .keys import kv_block_key, model_fingerprint, sampled_state_dict_digest, state_dict_digest
from .kv_block import KVBlockCodec
from .lru import LRUCache
from .manager import CacheManager, Codec
from .redis_cache import RedisCache
from .tensor_format import FORMAT_VERSION, RejectedValue, TensorCodec, decode_tensor, encode_tensor, read_header
from .tiered import TieredCache
from .ttl import TTLCache

__all__ = [
    "CacheBackend", "CacheManager", "CacheStats", "Codec", "EvictCallback", "FORMAT_VERSION", "KVBlockCodec",
    "Key", "LRUCache", "RedisCache", "RejectedValue", "SteadyClock", "TTLCache", "TensorCodec", "TieredCache",
    "decode_tensor", "encode_tensor", "kv_block_key", "model_fingerprint", "read_header", "sampled_state_dict_digest",
    "state_dict_digest",
]
