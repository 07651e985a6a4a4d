"""Prompts to token ids: raw text, or chat messages through the model's chat template."""

from __future__ import annotations


def encode_text(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                open_assistant_turn: bool = True) -> list[int]:
    """``[{"role", "content"}, ...]`` rendered with the chat template (``tools`` handed to it),
    ending with the assistant's turn opened (unless ``open_assistant_turn`` is False: a finished
    conversation). A tokenizer without a template gets the messages' text joined by newlines."""
    if not getattr(tokenizer, "chat_template", None):
        return encode_text(tokenizer, "\n".join(m["content"] for m in messages))
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=open_assistant_turn, tokenize=True)
    # transformers 5 returns a BatchEncoding here, older versions a plain list.
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
