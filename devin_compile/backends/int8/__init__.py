"""INT8 weights (one symmetric scale per output row): the output head's format (``lm_head="int8"``)."""
