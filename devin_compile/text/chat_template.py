"""Chat messages → prompt token ids through the tokenizer's own chat template.

Messages are OpenAI-shaped: ``{"role": "system"|"user"|"assistant"|"tool"|"developer",
"content": str | [{"type": "text", "text": str}, ...]}``. Anything else is a ``ValueError``
naming the message and field (the server turns it into a 400 with ``param="messages"``).
"""
from __future__ import annotations

ROLES = ("system", "user", "assistant", "tool", "developer")


def normalize_messages(messages) -> list[dict]:
    """Plain ``{"role", "content": str}`` dicts, checked; ``ValueError`` names what is wrong."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ValueError(f"messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}} "
                                     "(only text parts are supported)")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts, "
                             f"got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def _check_template(tokenizer) -> None:
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer: pass tokenizer= to optimize()")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; send a plain prompt (generate, "
                         "stream_text, or /v1/completions) instead")


def chat_prompt_ids(tokenizer, messages, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, ending with the assistant's turn
    (``add_generation_prompt``), or leaving the last message open (``continue_final_message``)."""
    _check_template(tokenizer)
    ids = tokenizer.apply_chat_template(normalize_messages(messages), add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message, tokenize=True,
                                        return_dict=False)
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def chat_prompt_text(tokenizer, messages, *, add_generation_prompt: bool = True,
                     continue_final_message: bool = False) -> str:
    """The text the chat template renders for ``messages`` (what :func:`chat_prompt_ids` tokenizes)."""
    _check_template(tokenizer)
    return tokenizer.apply_chat_template(normalize_messages(messages), add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tokenize=False)
