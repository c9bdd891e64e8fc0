"""Text around the token ids, for the library and the server alike: incremental detokenisation
with stop strings (:mod:`.detokenizer`), chat messages through the tokenizer's template
(:mod:`.chat_template`), and token logprobs in OpenAI's shapes (:mod:`.logprob_format`).
Nothing here imports torch or the rest of the package."""
from .chat_template import chat_prompt_ids, normalize_messages
from .detokenizer import IncrementalDetokenizer, StopStrings, TextStream
from .logprob_format import LogprobFormatter

__all__ = ["IncrementalDetokenizer", "LogprobFormatter", "StopStrings", "TextStream", "chat_prompt_ids",
           "normalize_messages"]
