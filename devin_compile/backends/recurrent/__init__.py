"""Kernels of recurrent layers (state-space mixers) over the runtime's state pool."""
