"""evaluate.decode_prompts: a follow-up turn comes after the model's own answer rendered as
regeneration renders it (capture/regenerate.py, whose conversations capture trains on), so the
engine is asked the prompt training saw. Checked with the Kimi-K2.5-shaped thinking template in
both modes: the two stages send the same tokens for the same conversation and the same answers.

    .venv/bin/python -m pytest tests/test_followup_turns.py -q
"""
from __future__ import annotations

import json

import pytest

from capture.regenerate import regenerate_conversations
from eagle3 import chat
from eagle3.evaluation import Prompt
from eagle3.targets import load_tokenizer, smollm2_tokenizer
from evaluate import decode_prompts

TEMPLATE = "conf/templates/kimi_k25_style.jinja"     # Kimi-K2.5's shape: <think> blocks, a `thinking` switch
FIRST, SECOND = "Name a colour.", "And a fruit?"


@pytest.fixture(scope="module")
def smol():
    return smollm2_tokenizer()


def kimi(smol, thinking: bool):
    return chat.use_template_kwargs(load_tokenizer(smol.name_or_path, TEMPLATE), {"thinking": thinking})


class Engine:
    """A greedy engine stand-in: per call the next scripted answer (its ids and the end-of-turn
    token, as the engines hand them back), and every prompt it was sent."""

    def __init__(self, tok, answers):
        self.tok, self.answers, self.prompts = tok, answers, []
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")

    def ids(self, prompt):
        self.prompts.append(list(prompt))
        return self.tok(self.answers[len(self.prompts) - 1], add_special_tokens=False)["input_ids"] + [self.im_end]

    def evaluation(self, prompt):                      # evaluate.Generate
        return self.ids(prompt), 0.0, {}

    def regeneration(self, prompts):                   # capture.regenerate.Generate: (ids, stopped)
        return [(self.ids(p)[:-1], True) for p in prompts]


@pytest.mark.parametrize("thinking", [True, False])
def test_the_followup_prompt_is_the_one_regeneration_sends(smol, tmp_path, thinking):
    tok = kimi(smol, thinking)
    answers = (["Blue is calm.</think>Blue.", "Apples grow on trees.</think>An apple."] if thinking
               else ["Blue.", "An apple."])
    ev_engine, regen_engine = Engine(tok, answers), Engine(tok, answers)
    [stats] = decode_prompts([Prompt("p1", [{"role": "user", "content": FIRST}], [SECOND])], tok,
                             ev_engine.evaluation, "test", chat.stop_ids(tok))
    out = regenerate_conversations([("p1", [{"role": "user", "content": FIRST}, {"role": "assistant", "content": "x"},
                                            {"role": "user", "content": SECOND}])],
                                   tok, regen_engine.regeneration, tmp_path / "regen.jsonl", 4096, progress=False)
    assert len(ev_engine.prompts) == len(regen_engine.prompts) == 2
    assert ev_engine.prompts == regen_engine.prompts
    # the stored conversation (what capture renders) holds the same first exchange
    messages = json.loads(out.read_text())["messages"]
    assert ev_engine.prompts[1] == chat.render_prompt(tok, messages[:3])
    assert stats.output_ids[0][-1] == ev_engine.im_end        # the engine's ids are kept as they came
    text = tok.decode(ev_engine.prompts[1])
    if thinking:
        # the answer is an assistant turn with its reasoning apart, rendered inside its think block
        # (the template keeps the last assistant turn's reasoning): the target's own tokens, with
        # no second </think> as plain content
        assert messages[1] == {"role": "assistant", "content": "Blue.", "reasoning_content": "Blue is calm."}
        assert text.endswith(f"<think>Blue is calm.</think>Blue.<|im_end|><|im_user|>user<|im_middle|>{SECOND}"
                             "<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
        assert text.count("</think>") == 1
    else:
        assert messages[1] == {"role": "assistant", "content": "Blue."}
        assert text.endswith(f"<think></think>Blue.<|im_end|><|im_user|>user<|im_middle|>{SECOND}<|im_end|>"
                             "<|im_assistant|>assistant<|im_middle|><think></think>")
