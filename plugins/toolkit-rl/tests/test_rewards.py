"""Built-in rewards, --reward parsing, advantages: against TRL's reward functions and the formulas they follow."""

from __future__ import annotations

import math
import os

import pytest
import torch

from toolkit.errors import ConfigError, RegistryError
from toolkit.plugins import get_plugin_manager
from toolkit.recipe import resolve_recipe
from toolkit_rl import phase, rewards

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def recipe(**sections):
    return resolve_recipe({"loss": "grpo", **sections})


def test_answer_match_modes():
    records = [{"answer": "Paris"}, {"answer": ["Rome", "Roma"]}, {}]
    completions = ["  the paris! ", "Roma", "anything"]
    normalised = rewards.AnswerReward()(None, completions, None, records)
    exact = rewards.AnswerReward(rewards.AnswerConfig(mode="exact"))(None, ["Paris ", "rome", "x"], None, records)
    contains = rewards.AnswerReward(rewards.AnswerConfig(mode="contains"))(
        None, ["It is Paris.", "Romania", "x"], None, records)
    assert normalised == [1.0, 1.0, None]
    assert exact == [1.0, 0.0, None]
    assert contains == [1.0, 0.0, None]  # a word match: "Roma" is not in "Romania"


def test_format_reward_matches_the_whole_completion_and_checks_the_pattern():
    reward = rewards.FormatReward()
    assert reward(None, ["<think>a\nb</think> <answer>4</answer>", "<answer>4</answer>", "x <think></think><answer></answer>"],
                  None, [{}] * 3) == [1.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="not a valid regular expression"):
        rewards.FormatReward(rewards.FormatConfig(pattern="(unclosed"))


def test_overlong_penalty_equals_trl():
    from trl.rewards import get_soft_overlong_punishment

    ids = [[1] * n for n in range(0, 24)]
    ours = rewards.OverlongReward(rewards.OverlongConfig(max_length=16, cache=6))(None, None, ids, None)
    assert ours == pytest.approx(get_soft_overlong_punishment(16, 6)(completion_ids=ids))
    assert min(ours) == -1.0 and max(ours) == 0.0 and len(set(ours)) > 3


def test_length_reward():
    assert rewards.LengthReward(rewards.LengthConfig(target=4))(None, None, [[1] * 4, [1] * 6, [1]], None) == [0.0, -0.5, -0.75]


def test_reward_specs_names_weights_functions_and_files(tmp_path):
    script = tmp_path / "my_rewards.py"
    script.write_text("def shout(prompts, completions, completion_ids, answer, **kw):\n"
                      "    return [1.0 if c.isupper() else None for c in completions]\n")
    built = rewards.build_rewards(["answer:2", f"{script}:shout:0.5", "string:capwords"], recipe(), get_plugin_manager())
    assert [(w.label, w.weight) for w in built] == [("answer", 2.0), ("shout", 0.5), ("capwords", 1.0)]
    scores = built[1].reward(["p", "p"], ["YES", "no"], [[1], [2]], [{"answer": "a"}, {"answer": "b"}])
    assert scores == [1.0, None]


def test_reward_options_come_from_the_recipe_section():
    built = rewards.build_rewards(["answer"], recipe(answer={"mode": "exact", "column": "solution"}), get_plugin_manager())
    assert built[0].reward.config.mode == "exact" and built[0].reward.config.column == "solution"


@pytest.mark.parametrize("spec,message", [
    ("nosuch", "unknown reward 'nosuch'"),
    ("json:no_such_function", "has no function 'no_such_function'"),
    ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
    ("missing.py:f", "does not exist"),
])
def test_bad_reward_specs_are_named(spec, message):
    with pytest.raises((ConfigError, RegistryError), match=message):
        rewards.build_rewards([spec], recipe(), get_plugin_manager())


def test_a_reward_function_returning_the_wrong_count_is_named():
    reward = rewards.FunctionReward(lambda **kw: [1.0], "mod:f")
    with pytest.raises(Exception, match="mod:f must return one number"):
        reward(["a", "b"], ["x", "y"], [[1], [2]], [{}, {}])


def test_group_advantages_follow_trl():
    from trl.trainer.utils import nanstd

    g = torch.Generator().manual_seed(0)
    total = torch.randn(12, generator=g, dtype=torch.float64)
    total[5] = math.nan  # a completion no reward applied to
    advantages, _ = phase.nan_group_advantages(total, 4, "group", None)
    grouped = total.view(3, 4)
    expected = (grouped - torch.nanmean(grouped, 1, keepdim=True)) / (nanstd(grouped, dim=1).unsqueeze(1) + 1e-4)
    expected = torch.nan_to_num(expected.flatten(), nan=0.0)
    torch.testing.assert_close(advantages, expected)
    assert advantages[5] == 0.0
    unscaled, _ = phase.nan_group_advantages(total, 4, "none", None)
    torch.testing.assert_close(unscaled[:4], grouped[0] - grouped[0].mean())


def test_combined_rewards_are_weighted_and_nan_only_when_no_reward_applied():
    table = torch.tensor([[1.0, math.nan], [math.nan, math.nan], [0.0, 2.0]], dtype=torch.float64)
    total = phase.combine(table, [2.0, 0.5])
    assert total[0] == 2.0 and math.isnan(total[1]) and total[2] == 1.0


def reward_model_dir(path, tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def test_reward_model_scores_the_closed_conversation_like_the_classifier(tmp_path):
    """As TRL scores a conversational prompt: prompt messages + the completion as the assistant's turn, rendered by
    the reward model's chat template (what toolkit-dpo's rm trains on: its value head reads the token after the
    closed turn); a raw text prompt is prompt + completion."""
    from transformers import AutoTokenizer

    from toolkit.models import materialize_preset

    tokenizer = AutoTokenizer.from_pretrained(materialize_preset("tiny-llama"))
    model = reward_model_dir(tmp_path / "rm", tokenizer)
    built = rewards.build_rewards([str(tmp_path / "rm")], recipe(), get_plugin_manager())
    reward = built[0].reward
    records = [{"prompt": "a?", "answer": "x"}, {"messages": [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "longer question?"},
                                                              {"role": "assistant", "content": "no"}]}]
    conversations = [[{"role": "user", "content": "a?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "longer question?"}]]
    prompts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    completions = ["yes", "no, it is not"]

    def classifier(text):
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            return float(model(input_ids=ids).logits[0, 0])

    scores = reward(prompts, completions, None, records)
    for conversation, completion, score in zip(conversations, completions, scores):
        closed = tokenizer.apply_chat_template([*conversation, {"role": "assistant", "content": completion}], tokenize=False)
        assert closed.endswith("<|im_end|>\n")
        assert score == pytest.approx(classifier(closed), rel=1e-4, abs=1e-5)
        assert score != pytest.approx(classifier(closed.removesuffix("<|im_end|>\n")), rel=1e-3)
    reward.raw_prompts = True
    raw = reward(["Q: a? "], ["yes"], None, [{"prompt": "Q: a? "}])
    assert raw[0] == pytest.approx(classifier("Q: a? yes"), rel=1e-4, abs=1e-5)
    with pytest.raises(ConfigError, match="no config.json"):
        rewards.RewardModelReward(rewards.RewardModelConfig(path=str(tmp_path)))


def test_a_reward_model_with_its_own_code_is_refused_even_when_someone_answers_yes(tmp_path, monkeypatch):
    """--reward DIR whose config names its own code (auto_map): transformers would ask on the terminal."""
    from transformers import LlamaConfig

    from toolkit.errors import ModelError
    from toolkit.testing import plant_model_code

    directory = tmp_path / "rm"
    LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_labels=1).save_pretrained(directory)
    marker = tmp_path / "ran"
    plant_model_code(directory, "evil-rm", marker)
    monkeypatch.setattr("builtins.input", lambda *args: "y")
    with pytest.raises(ModelError, match="asks to run the model's own Python code .configuration_evil.; it was not run"):
        built = rewards.build_rewards([str(directory)], recipe(), get_plugin_manager())
        built[0].reward(["Q: a? "], ["yes"], None, [{}])
    assert not marker.exists()
