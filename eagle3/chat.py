"""Chat conversations as every stage sees them: which are usable, how a prompt is rendered, and
which tokens end a reply. Regeneration, training data and evaluation all use these, so they agree
on where an answer stops and on what a prompt looks like.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Sequence

ROLES = ("system", "user", "assistant")
_MARKER = "EAGLE3_END_OF_TURN_MARKER"


def conversation_problem(messages, needs: str = "assistant") -> Optional[str]:
    """None when `messages` is a usable conversation, else why not (data reports count bad records
    under these reasons).

    Usable: a non-empty list of {role, content} turns with roles system/user/assistant, string
    content, and at least one `needs` turn: training needs an answer to learn from ("assistant");
    regeneration and evaluation need a question to answer ("user").
    """
    if messages is None or (messages and not isinstance(messages, list)):
        return "malformed record"
    if not messages:
        return "empty"
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            return "malformed turn"
        if m["role"] not in ROLES:
            return "unknown role"
        if not isinstance(m["content"], str):
            return "non-string content"
    if not any(m["role"] == needs for m in messages):
        return f"no {needs} turn"
    return None


def render_prompt(tokenizer, messages: Sequence[dict]) -> List[int]:
    """Token ids of the conversation with the assistant header appended (the chat template's own
    text: its special tokens are already in it, so none are added again)."""
    text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_ids(tokenizer, model_dir: Optional[Path] = None) -> List[int]:
    """The tokens that end a reply, the end-of-turn token first (generation pads with it).

    The end-of-turn token is the special token the chat template writes right after an answer
    (`<|im_end|>` for ChatML and Kimi, `<|eot_id|>` for Llama-3), found by rendering a turn rather
    than by a list of names. The tokenizer's eos and generation_config.json's eos ids join it: a
    model may end there instead. They never replace it, since a tokenizer's eos need not close a
    turn (SmolLM2's GGUF tokenizer has reported eos = <|im_start|>, the token that opens one).
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"},
                                          {"role": "assistant", "content": _MARKER}], tokenize=False)
    suffix = text[text.rindex(_MARKER) + len(_MARKER):]
    ids = list(tokenizer(suffix, add_special_tokens=False)["input_ids"]) if suffix else []
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    out = [int(ids[0])] if ids and ids[0] in special else []
    more = [tokenizer.eos_token_id]
    gen = Path(model_dir) / "generation_config.json" if model_dir else None
    if gen is not None and gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        more += eos if isinstance(eos, list) else [eos]
    out += sorted({int(e) for e in more if e is not None} - set(out))
    if not out:
        raise ValueError("cannot tell where a reply ends: the chat template closes a turn with no "
                         "special token and neither the tokenizer nor generation_config.json has an eos")
    return out
