"""Whether a request prunes: :class:`enable_kv_pruning` (decorator / ``with`` block) and
:func:`resolve_request` (per-request settings > active block > the model's default)."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

from ...config import KVPruneConfig

_ACTIVE: contextvars.ContextVar[KVPruneConfig | None] = contextvars.ContextVar("devin_kv_prune", default=None)


class enable_kv_pruning(contextlib.ContextDecorator):
    """Turn KV pruning on for the calls inside (decorator or ``with`` block).

    ``@devin_compile.enable_kv_pruning(threshold=0.05, step_interval=2)`` on a function that
    generates: requests added inside it prune with these settings (unless their
    ``SamplingParams.kv_prune`` says otherwise), and ``optimize()`` called inside it without
    ``kv_prune=`` compiles the pruning nodes with them. A model optimized without
    ``kv_prune=`` outside the block has no pruning nodes; adding a request to it inside the
    block is a ``ValueError``.
    """

    def __init__(self, **settings: Any) -> None:
        self.config = KVPruneConfig.coerce(dict(settings), "enable_kv_pruning") or KVPruneConfig()
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> KVPruneConfig:
        self._tokens.append(_ACTIVE.set(self.config))
        return self.config

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self._tokens.pop())


def active_config() -> KVPruneConfig | None:
    """The configuration of the innermost active :class:`enable_kv_pruning`, if any."""
    return _ACTIVE.get()


def resolve_request(model_setting: KVPruneConfig | None, params: Any) -> KVPruneConfig | None:
    """The pruning configuration of a new request (``ValueError`` if it cannot prune here).

    ``model_setting`` is the engine's resolved setting: None when the model has no
    ``devin::kv_prune`` nodes, else the ``optimize(kv_prune=...)`` configuration.
    Order: ``params.kv_prune`` (False: off) > active :func:`enable_kv_pruning` >
    ``model_setting`` when ``enabled``.
    """
    explicit = getattr(params, "kv_prune", None)
    if explicit is False:
        return None
    cfg = KVPruneConfig.coerce(explicit, "SamplingParams.kv_prune") if explicit is not None else active_config()
    if cfg is None and model_setting is not None and model_setting.enabled:
        cfg = model_setting
    if cfg is not None and model_setting is None:
        where = "SamplingParams.kv_prune" if explicit is not None else "enable_kv_pruning"
        raise ValueError(f"{where} asks for KV pruning but this model was optimized without kv_prune=, so its "
                         "decode graph has no devin::kv_prune nodes; optimize(model, kv_prune={...}) (or "
                         "call optimize() inside enable_kv_pruning)")
    return cfg
