"""Chat conversations as every stage sees them: which are usable, how a prompt is rendered, and
which tokens end a reply. Regeneration, training data and evaluation all use these, so they agree
on where an answer stops and on what a prompt looks like.

The chat template's variables (target.chat_template_kwargs, e.g. Kimi-K2.5's `thinking`) travel
with the tokenizer (load_tokenizer binds them) and every rendering here passes them on, so no stage
can render a conversation differently from another. An assistant turn may carry the template's
`reasoning_content` besides its `content` (a thinking model's reasoning, see assistant_turn).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

ROLES = ("system", "user", "assistant")
REASONING = "reasoning_content"        # the field chat templates (Kimi, Qwen3, DeepSeek-R1) render reasoning from
_MARKER = "EAGLE3_END_OF_TURN_MARKER"
_REASONING_MARKER = "EAGLE3_REASONING_MARKER"
_KWARGS_ATTR = "eagle3_chat_template_kwargs"


def load_tokenizer(target_dir, target):
    """The target's tokenizer as every stage renders with it: target.chat_template replaces its
    template, and target.chat_template_kwargs go to every rendering (use_template_kwargs)."""
    from eagle3.targets import load_tokenizer as load

    tok = load(target_dir, target.chat_template, target.trust_remote_code)
    return use_template_kwargs(tok, target.chat_template_kwargs)


def use_template_kwargs(tokenizer, kwargs: Mapping[str, Any]):
    """Bind the chat template's variables to `tokenizer` (returned): render_text passes them on."""
    setattr(tokenizer, _KWARGS_ATTR, dict(kwargs))
    return tokenizer


def template_kwargs(tokenizer) -> Dict[str, Any]:
    return dict(getattr(tokenizer, _KWARGS_ATTR, None) or {})


def render_text(tokenizer, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    """The chat template's text of `messages`, with the tokenizer's bound template variables."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs(tokenizer))


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
        if not isinstance(m["content"], str) or not isinstance(m.get(REASONING, ""), str):
            return "non-string content"
    if not any(m["role"] == needs for m in messages):
        return f"no {needs} turn"
    return None


def render_prompt(tokenizer, messages: Sequence[dict]) -> List[int]:
    """Token ids of the conversation with the assistant header appended (the chat template's own
    text: its special tokens are already in it, so none are added again)."""
    text = render_text(tokenizer, messages, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def assistant_turn(tokenizer, answer: str) -> dict:
    """The assistant message whose rendering continues the generation prompt with `answer` (a
    decoded reply, its end-of-turn token cut off), so training sees the tokens the target wrote.

    Mostly {"role": "assistant", "content": answer}. A template that renders reasoning_content
    after the generation prompt, as `<reasoning><separator><content>` (Kimi-K2.5 with thinking on:
    the prompt ends in `<think>`, the separator is `</think>`), gets the answer split at its first
    separator; a reply cut off before it is all reasoning. Both are found by rendering a probe
    turn, not from per-model patterns.
    """
    user = [{"role": "user", "content": "hi"}]
    prompt = render_text(tokenizer, user, add_generation_prompt=True)
    probe = render_text(tokenizer, user + [{"role": "assistant", "content": _MARKER,
                                            REASONING: _REASONING_MARKER}], add_generation_prompt=False)
    rest = probe[len(prompt):] if probe.startswith(prompt) else ""
    if _REASONING_MARKER not in rest or _MARKER not in rest:
        return {"role": "assistant", "content": answer}
    before, after = rest.split(_REASONING_MARKER, 1)
    separator = after[:after.index(_MARKER)]
    if not separator or not answer.startswith(before):
        return {"role": "assistant", "content": answer}
    reasoning, _, content = answer[len(before):].partition(separator)
    return {"role": "assistant", "content": content, REASONING: reasoning}


def answer_turn(tokenizer, ids: Sequence[int]) -> dict:
    """The assistant message of a generated answer's ids (cut before its end-of-turn token): decoded
    with its special tokens, a thinking model's reasoning split off by assistant_turn."""
    return assistant_turn(tokenizer, tokenizer.decode(list(ids), skip_special_tokens=False))


def stop_ids(tokenizer, model_dir: Optional[Path] = None) -> List[int]:
    """The tokens that end a reply, the end-of-turn token first (generation pads with it).

    The end-of-turn token is the special token the chat template writes right after an answer
    (`<|im_end|>` for ChatML and Kimi, `<|eot_id|>` for Llama-3), found by rendering a turn rather
    than by a list of names. The tokenizer's eos and generation_config.json's eos ids join it: a
    model may end there instead. They never replace it, since a tokenizer's eos need not close a
    turn (SmolLM2's GGUF tokenizer has reported eos = <|im_start|>, the token that opens one).
    """
    text = render_text(tokenizer, [{"role": "user", "content": "hi"},
                                   {"role": "assistant", "content": _MARKER}], add_generation_prompt=False)
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
