"""Data pipeline: formats, label masking, truncation, packing, sharding, and errors that name file and line."""

from __future__ import annotations

import json

import pytest

from toolkit.contracts import IGNORE_INDEX
from toolkit.data.pipeline import Batches, collate, load_examples
from toolkit.errors import DataError
from toolkit.testing import write_jsonl


def trained_text(tokenizer, example):
    seq = example.sequences[0]
    # labels are shifted: label t predicts token t + 1
    ids = [seq.input_ids[t + 1] for t, label in enumerate(seq.labels[:-1]) if label != IGNORE_INDEX]
    return tokenizer.decode(ids)


def test_sft_trains_only_on_assistant_replies(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Again?"},
        {"role": "assistant", "content": "Yes indeed."}]}])
    (example,), _ = load_examples([path], tokenizer, train_on="assistant")
    assert trained_text(tokenizer, example) == "Hello there.<|im_end|>Yes indeed.<|im_end|>"
    seq = example.sequences[0]
    assert all(seq.labels[t] in (IGNORE_INDEX, seq.input_ids[t + 1]) for t in range(len(seq.labels) - 1))


# Family templates as their tokenizer_config.json ships them (whitespace aside)
PHI3_TEMPLATE = (  # microsoft/Phi-3-mini-4k-instruct: the conversation's end adds eos_token, a following turn does not
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
GEMMA_TEMPLATE = (  # google/gemma-2-9b-it: bos, role "model", no system role
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}"
    "{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
    "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


@pytest.mark.parametrize(("template", "expected"), [
    (PHI3_TEMPLATE, "Hello there.<|end|>Yes indeed.<|end|>\n<|im_end|>"),
    (GEMMA_TEMPLATE, "Hello there.<end_of_turn>Yes indeed.<end_of_turn>"),
], ids=["phi3", "gemma"])
def test_family_templates_train_only_on_assistant_replies(tokenizer, tmp_path, template, expected):
    """Phi-3's template writes eos_token only after the last turn: an earlier reply's span stopped that many
    characters into the next user turn (which then trained) before the closing suffix was taken off."""
    from toolkit.data.template import ChatTemplate

    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = template
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [
        {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello there."},
        {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Yes indeed."}]}])
    (example,), _ = load_examples([path], tokenizer, train_on="assistant")
    assert trained_text(tokenizer, example) == expected
    assert ChatTemplate(tokenizer).closing_suffix() == ("<|im_end|>" if template is PHI3_TEMPLATE else "")


GLM4_TEMPLATE = (  # THUDM/glm-4-9b-chat-hf (tools block left out): no end-of-turn marker; the next role token or EOS ends a turn
    "[gMASK]<sop>{% for item in messages %}{% if item['role'] == 'system' %}<|system|>\n{{ item['content'] }}"
    "{% elif item['role'] == 'user' %}<|user|>\n{{ item['content'] }}"
    "{% elif item['role'] == 'assistant' %}<|assistant|>\n{{ item['content'] }}"
    "{% elif item['role'] == 'tool' %}<|observation|>\n{{ item['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
GLM4_SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]


def glm4_tokenizer(tokenizer):
    """The bundled tokenizer with GLM-4's special tokens, eos_token and chat template."""
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>", "additional_special_tokens": GLM4_SPECIALS[1:]})
    tokenizer.chat_template = GLM4_TEMPLATE
    return tokenizer


def glm4_model(tokenizer):
    """A tiny GLM-4 whose generation config names GLM-4's stop ids (EOS, <|user|>, <|observation|>) as glm-4-9b-chat does."""
    import torch
    from transformers import GenerationConfig, Glm4Config, Glm4ForCausalLM

    stops = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    config = Glm4Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=stops,
                        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Glm4ForCausalLM(config)
    model.generation_config = GenerationConfig.from_model_config(config)
    return model


GLM4_CHAT = [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello there."},
             {"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."},
             {"role": "user", "content": "Again?"}, {"role": "assistant", "content": "Yes indeed."}]


def test_glm4_replies_train_their_stop_token(tokenizer, tmp_path):
    """GLM-4's template writes nothing after a reply: the token that ends it (the next turn's <|observation|> or
    <|user|>, EOS after the last) must train, and be one of the ids transformers' generation config stops on."""
    tokenizer = glm4_tokenizer(tokenizer)
    stops = glm4_model(tokenizer).generation_config.eos_token_id
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": GLM4_CHAT}])
    (example,), _ = load_examples([path], tokenizer, train_on="assistant")
    seq = example.sequences[0]
    trained = [t + 1 for t, label in enumerate(seq.labels[:-1]) if label != IGNORE_INDEX]
    runs = [[trained[0]]]
    for position in trained[1:]:
        runs[-1].append(position) if position == runs[-1][-1] + 1 else runs.append([position])
    assert [tokenizer.decode([seq.input_ids[p] for p in run]) for run in runs] == [
        "\nHello there.<|observation|>", "\nIt is 42.<|user|>", "\nYes indeed.<|endoftext|>"]
    assert all(seq.input_ids[run[-1]] in stops for run in runs)
    assert seq.input_ids[-1] == tokenizer.eos_token_id  # appended once, at the end of the conversation


def test_glm4_sft_model_stops_generating(tokenizer, tmp_path):
    """A tiny GLM-4 fitted to a conversation's trained tokens ends its reply with a stop id of its generation config
    (without the stop token in the labels it never learns to, and generation runs to max_new_tokens)."""
    import torch

    from toolkit.data.template import ChatTemplate

    tokenizer = glm4_tokenizer(tokenizer)
    model = glm4_model(tokenizer)
    chat = GLM4_CHAT[:2]
    (example,), _ = load_examples([write_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}])], tokenizer, train_on="assistant")
    ids, labels = torch.tensor([example.sequences[0].input_ids]), torch.tensor([example.sequences[0].labels])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        loss = torch.nn.functional.cross_entropy(model(ids).logits[0], labels[0], ignore_index=IGNORE_INDEX)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    prompt = tokenizer(ChatTemplate(tokenizer).render(chat[:1], add_generation_prompt=True), add_special_tokens=False,
                       return_tensors="pt").input_ids
    out = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert out[-1] in model.generation_config.eos_token_id and len(out) < 20, tokenizer.decode(out)
    assert tokenizer.decode(out[:-1]) == "\nHello there."


def test_pt_trains_on_every_token(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Ok."}]}])
    (example,), _ = load_examples([path], tokenizer, train_on="all")
    seq = example.sequences[0]
    assert seq.labels[:-1] == seq.input_ids[1:] and seq.labels[-1] == IGNORE_INDEX


@pytest.mark.parametrize("record,expected", [
    ({"instruction": "Add", "input": "1 and 2", "output": "3"}, "3<|im_end|>"),
    ({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A long answer"}]}, "A long answer<|im_end|>"),
])
def test_alpaca_and_sharegpt(tokenizer, tmp_path, record, expected):
    (example,), _ = load_examples([write_jsonl(tmp_path / "d.jsonl", [record])], tokenizer)
    assert trained_text(tokenizer, example) == expected


def test_text_format_and_column_remapping(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"body": "plain words here"}])
    (example,), _ = load_examples([path], tokenizer, columns={"text": "body"}, train_on="all")
    assert tokenizer.decode(example.sequences[0].input_ids) == "plain words here<|im_end|>"


def test_truncation_is_counted(tokenizer, tmp_path):
    chats = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 200}]},
             {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "short"}]}]
    examples, stats = load_examples([write_jsonl(tmp_path / "c.jsonl", chats)], tokenizer, seq_len=32)
    assert stats.truncated == 1 and max(len(e.sequences[0].input_ids) for e in examples) == 32
    assert examples[0].sequences[0].labels[-1] == IGNORE_INDEX
    assert "1 sequences truncated" in stats.summary()


def test_malformed_jsonl_names_file_and_line(tokenizer, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad.jsonl, line 2"):
        load_examples([str(path)], tokenizer)


def test_missing_columns_lists_found_columns(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "x", "output": "y"}, {"instruction": "x", "answer": "y"}])
    with pytest.raises(DataError, match=r"line 2: missing column 'output'; columns found: instruction, answer"):
        load_examples([path], tokenizer)
    with pytest.raises(DataError, match="cannot tell the record format.*question"):
        load_examples([write_jsonl(tmp_path / "e.jsonl", [{"question": "x"}])], tokenizer)


def test_empty_after_filtering(tokenizer, tmp_path):
    long_prompt = [{"messages": [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "x"}]}]
    with pytest.raises(DataError, match="no trainable examples"):
        load_examples([write_jsonl(tmp_path / "d.jsonl", long_prompt)], tokenizer, seq_len=16)


def test_packing_resets_positions_and_isolates_samples(tokenizer, tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"instruction": "say", "output": f"sample number {i} " * (i + 1)} for i in range(6)])
    examples, _ = load_examples([path], tokenizer)
    batch = collate(examples, [[0, 1, 2]], pad_id=3, packing=True)
    assert batch["input_ids"].shape[0] == 1 and batch["num_sequences"] == 3
    seq_ids, pos = batch["sequence_ids"][0], batch["position_ids"][0]
    for s in range(3):
        positions = pos[seq_ids == s]
        assert positions.tolist() == list(range(len(examples[s].sequences[0].input_ids)))
    # the last token of each packed sample predicts nothing across the boundary
    ends = [int((seq_ids == s).nonzero().max()) for s in range(3)]
    assert all(batch["labels"][0, e] == IGNORE_INDEX for e in ends)


def test_order_is_deterministic_and_sharded(tokenizer):
    examples, _ = load_examples(["demo"], tokenizer)
    kwargs = dict(seed=3, seq_len=128, packing=False, micro_batch_size=2, global_batch_size=8, pad_id=3)
    whole = Batches(examples, dp_rank=0, dp_world_size=1, **kwargs)
    again = Batches(examples, dp_rank=0, dp_world_size=1, **kwargs)
    assert whole.step_units(5) == again.step_units(5)
    shards = [Batches(examples, dp_rank=r, dp_world_size=2, **kwargs) for r in range(2)]
    full = [mb["sequence_meta"]["dataset_index"].tolist() for mb in whole.micro_batches(5)]
    split = [mb["sequence_meta"]["dataset_index"].tolist() for b in shards for mb in b.micro_batches(5)]
    assert sorted(sum(full, [])) == sorted(sum(split, [])) and len(sum(split, [])) == 8
    other = Batches(examples, dp_rank=0, dp_world_size=1, **{**kwargs, "seed": 4})
    assert other.step_units(0) != whole.step_units(0)


def test_data_inspect_reads_with_the_training_format_flags(cli_runner, tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text(json.dumps({"body": "Lopehes is a city by the sea."}) + "\n" + json.dumps({"body": "Second note."}) + "\n")
    result = cli_runner.invoke("data", "inspect", str(path), "--dataset-format", "text", "--text-column", "body", "-n", "1")
    assert result.exit_code == 0, result.output
    shown = result.stdout.replace("[[", "").replace("]]", "")
    assert "Lopehes is a city by the sea." in shown and "Second note." not in shown
    without = cli_runner.invoke("data", "inspect", str(path), "--dataset-format", "text")
    assert without.exit_code != 0 and "text" in without.output
    asked = tmp_path / "asked.jsonl"
    asked.write_text(json.dumps({"question": "Capital of Lopehes?", "answer": "Vemor"}) + "\n")
    renamed = cli_runner.invoke("data", "inspect", str(asked), "--columns", "instruction=question", "--columns", "output=answer")
    assert renamed.exit_code == 0, renamed.output
    prompt, trained = renamed.stdout.split("--- sample 0")[1].split("[[", 1)
    assert "Capital of Lopehes?" in prompt and "Vemor" in trained  # the answer column is what trains
