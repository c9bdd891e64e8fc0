"""``devin::`` custom ops (torch.library): the only door between graphs and kernels."""
from . import int4_linear  # noqa: F401  (registers devin::int4_linear)
from . import paged_attention  # noqa: F401  (registers devin::paged_attention)
from . import kv_prune  # noqa: F401,E402  (registers devin::kv_prune)
from . import rms_norm  # noqa: F401,E402  (registers devin::rms_norm)
from . import rotary_heads  # noqa: F401,E402  (registers devin::rotary_heads)
from . import silu_mul  # noqa: F401,E402  (registers devin::silu_mul)
from . import mla_attention  # noqa: F401,E402  (registers devin::mla_attention)
from . import grouped_linear  # noqa: F401,E402  (registers devin::grouped_linear)
