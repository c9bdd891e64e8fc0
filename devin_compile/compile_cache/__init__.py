"""On-disk cache of compiled programs, keyed by weights, model, options, versions and ISA.

What ``optimize()`` would otherwise redo on every start of the same model: capture and the pass
pipeline. An entry holds the compiled program (its graphs' code and tables, :mod:`.program_file`)
and the weights the passes made (packed, fused, quantized); the model's own weights are bound by
name on load, not stored. Entries live under ``$DEVIN_COMPILE_CACHE`` (default
``~/.cache/devin_compile``) in ``programs/``, are checked by xxh3, written atomically under a file
lock and bounded in size, least recently used first (:mod:`.store`). ``optimize(...,
compile_cache=False)`` / ``--no-compile-cache`` / ``DEVIN_COMPILE_CACHE_OFF=1`` turn it off;
``devin-compile cache ls|clear`` shows and empties it. What the cache cannot hold (``compile_decode``'s
compiled callables) is compiled after it is read, with torch's own compile caches pointed at
``inductor/`` under the same root (:mod:`.inductor_cache`).
"""
from __future__ import annotations

from .cached_compile import cached_compile
from .inductor_cache import inductor_dir, use_inductor_cache
from .key import KeyParts, folder_digest, key_parts, options_json, versions
from .program_file import Compiled, NotCacheable
from .store import ProgramStore, off_by_env

__all__ = ["Compiled", "KeyParts", "NotCacheable", "ProgramStore", "cached_compile", "folder_digest", "inductor_dir",
           "key_parts", "off_by_env", "options_json", "use_inductor_cache", "versions"]
