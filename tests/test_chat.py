"""eagle3/chat.py: where a reply ends, how a prompt renders, which conversations are usable.

    .venv/bin/python -m pytest tests/test_chat.py -q
"""
from __future__ import annotations

import copy
import json

import pytest

from eagle3.chat import conversation_problem, render_prompt, stop_ids
from eagle3.targets import resolve_target, smollm2_tokenizer

TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256}


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def test_smollm2_replies_end_at_im_end(tok):
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end == 2 and stop_ids(tok) == [2]


def test_an_eos_that_opens_turns_joins_the_end_of_turn_token_which_stays_first(tok):
    """A tokenizer whose eos is <|im_start|> (id 1): generation must still stop, and pad, at
    <|im_end|>; stopping at the eos too is harmless."""
    odd = copy.deepcopy(tok)
    odd.eos_token = "<|im_start|>"
    assert odd.eos_token_id == 1
    assert stop_ids(odd) == [2, 1]


def test_a_tiny_target_adds_its_generation_config_eos(tok, tmp_path):
    tiny = resolve_target("random", "", "tiny_chat", "llama", TINY, 0)
    assert stop_ids(tok, tiny) == [2]                         # its generation_config says eos 2 too
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    assert stop_ids(tok, tmp_path) == [2, 0]


def test_render_prompt_ends_with_the_assistant_header(tok):
    ids = render_prompt(tok, [{"role": "user", "content": "Hello"}])
    assert tok.decode(ids).endswith("<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(ids).count("<|im_start|>") == 3          # the template's default system turn


@pytest.mark.parametrize("messages, needs, problem", [
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "assistant", None),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "q"}], "user", None),
    ([{"role": "user", "content": "q"}], "assistant", "no assistant turn"),
    ([{"role": "assistant", "content": "a"}], "user", "no user turn"),
    (None, "user", "malformed record"),
    ({"role": "user"}, "user", "malformed record"),
    ([], "user", "empty"),
    (["q"], "user", "malformed turn"),
    ([{"role": "user"}], "user", "malformed turn"),
    ([{"role": "bing", "content": "q"}], "user", "unknown role"),
    ([{"role": "user", "content": ["q"]}], "user", "non-string content"),
])
def test_conversation_problem(messages, needs, problem):
    assert conversation_problem(messages, needs) == problem


@pytest.mark.parametrize("thinking", [True, False])
def test_assistant_turn_splits_a_thinking_reply_where_the_template_would(tok, thinking):
    """The stored turn re-renders to the generation prompt followed by exactly the reply (and the
    end of turn); with thinking on the reasoning goes to reasoning_content, split at </think>."""
    from eagle3.chat import assistant_turn, render_text, use_template_kwargs
    from eagle3.targets import load_tokenizer

    kimi = use_template_kwargs(load_tokenizer(tok.name_or_path, "conf/templates/kimi_k25_style.jinja"),
                               {"thinking": thinking})
    user = [{"role": "user", "content": "Name a colour."}]
    reply = "Pick one.</think>Green." if thinking else "Green."
    turn = assistant_turn(kimi, reply)
    assert turn == ({"role": "assistant", "content": "Green.", "reasoning_content": "Pick one."} if thinking
                    else {"role": "assistant", "content": "Green."})
    assert render_text(kimi, user + [turn], False) == render_text(kimi, user, True) + reply + "<|im_end|>"
    if thinking:   # cut off while reasoning: all of it is reasoning
        assert assistant_turn(kimi, "Hmm, let me") == {"role": "assistant", "content": "", "reasoning_content": "Hmm, let me"}
    assert stop_ids(kimi) == [2]
    assert assistant_turn(tok, reply) == {"role": "assistant", "content": reply}   # a template without reasoning
