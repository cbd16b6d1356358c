"""The preference and kto formats with the core's tokenizer and chat template; data validation; registration."""

from __future__ import annotations

import json
import os

import pytest

from toolkit.contracts import IGNORE_INDEX
from toolkit.errors import DataError
from toolkit_dpo.formats import KTOFormat, PreferenceFormat, PreferenceFormatConfig
from toolkit_dpo.losses import KTOConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from toolkit.models import TOKENIZER_DIR

    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def template(tokenizer):
    from toolkit.data.template import ChatTemplate

    return ChatTemplate(tokenizer)


def trained_text(tokenizer, seq) -> str:
    """Decode the label tokens; labels are shifted, so label t is token t+1 of the ids."""
    for t, label in enumerate(seq.labels):
        if label != IGNORE_INDEX:
            assert label == seq.input_ids[t + 1]
    return tokenizer.decode([x for x in seq.labels if x != IGNORE_INDEX])


def test_text_pair_labels_only_the_response(tokenizer, template):
    example = PreferenceFormat().encode({"prompt": "Even or odd: 12", "chosen": "12 even", "rejected": "12 odd"},
                                        tokenizer, template)
    chosen, rejected = example.sequences
    assert (chosen.role, rejected.role, example.kind) == (0, 1, "preference")
    assert trained_text(tokenizer, chosen) == "12 even<|im_end|>"
    assert trained_text(tokenizer, rejected) == "12 odd<|im_end|>"
    assert chosen.labels[-1] == IGNORE_INDEX
    text = tokenizer.decode(chosen.input_ids)
    assert text.startswith("<|im_start|>user\nEven or odd: 12<|im_end|>\n<|im_start|>assistant\n")


def test_message_lists_label_only_the_final_reply(tokenizer, template):
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Name a colour"}]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "blue"}],
              "rejected": [{"role": "assistant", "content": "seven"}]}
    chosen, rejected = PreferenceFormat().encode(record, tokenizer, template).sequences
    assert trained_text(tokenizer, chosen) == "blue<|im_end|>"  # the earlier assistant turn is prompt, not trained
    assert trained_text(tokenizer, rejected) == "seven<|im_end|>"
    implicit = {"chosen": prompt + [{"role": "assistant", "content": "blue"}],
                "rejected": prompt + [{"role": "assistant", "content": "seven"}]}
    again = PreferenceFormat().encode(implicit, tokenizer, template).sequences
    assert again[0].input_ids == chosen.input_ids and again[0].labels == chosen.labels
    assert again[1].labels == rejected.labels


def test_raw_text_and_system_options(tokenizer, template):
    fmt = PreferenceFormat(PreferenceFormatConfig(raw_text=True))
    chosen, _ = fmt.encode({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, tokenizer, template).sequences
    assert tokenizer.decode(chosen.input_ids) == "2+2=4<|im_end|>"
    assert trained_text(tokenizer, chosen) == "4<|im_end|>"
    fmt = PreferenceFormat(PreferenceFormatConfig(system="Be brief."))
    chosen, _ = fmt.encode({"prompt": "q", "chosen": "a", "rejected": "b"}, tokenizer, template).sequences
    assert tokenizer.decode(chosen.input_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")


@pytest.mark.parametrize("record, message", [
    ({"prompt": "q", "chosen": "a"}, "needs column(s) 'rejected'; columns found: 'prompt', 'chosen'"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "column 'chosen' must be a string or a non-empty list"),
    ({"prompt": "q", "chosen": [{"role": "bot", "content": "a"}], "rejected": "b"}, "chosen[0] has role 'bot'"),
    ({"chosen": "a", "rejected": "b"}, "without a 'prompt' column, 'chosen' must be a conversation"),
    ({"chosen": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}],
      "rejected": [{"role": "user", "content": "y"}, {"role": "assistant", "content": "b"}]}, "must continue the same prompt"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": "big"}, "'margin' must be a number"),
])
def test_preference_errors_name_the_line_and_problem(tokenizer, template, record, message):
    with pytest.raises(DataError) as info:
        PreferenceFormat().encode(record, tokenizer, template, where="prefs.jsonl, line 7")
    assert "prefs.jsonl, line 7" in str(info.value) and message in str(info.value)


def test_kto_records_and_kl_sequences(tokenizer, template):
    fmt = KTOFormat()
    first = fmt.encode({"prompt": "p1", "completion": "c1", "label": True}, tokenizer, template)
    second = fmt.encode({"prompt": "p2", "completion": "c2", "label": "false"}, tokenizer, template)
    assert first.kind == "unpaired" and len(second.sequences) == 2
    scored, kl = second.sequences
    assert scored.meta == {"kto_label": 0.0, "kto_kl": 0.0} and kl.meta == {"kto_label": 0.0, "kto_kl": 1.0}
    assert trained_text(tokenizer, scored) == "c2<|im_end|>"
    assert trained_text(tokenizer, kl) == "c1<|im_end|>"  # the previous record's completion, mismatched prompt
    assert "p2" in tokenizer.decode(kl.input_ids)
    no_kl = KTOFormat(KTOConfig(kl=False)).encode({"prompt": "p", "completion": "c", "label": 1}, tokenizer, template)
    assert len(no_kl.sequences) == 1
    for label, desirable in ((0, 0.0), (1.0, 1.0), ("Undesirable", 0.0), ("1", 1.0)):
        seq = fmt.encode({"prompt": "p", "completion": "c", "label": label}, tokenizer, template).sequences[0]
        assert seq.meta["kto_label"] == desirable, label
    for label in ("maybe", 2, [1]):
        with pytest.raises(DataError, match="line 3: 'label' must be true/false"):
            fmt.encode({"prompt": "p", "completion": "c", "label": label}, tokenizer, template, where="k.jsonl, line 3")
    with pytest.raises(DataError, match="needs column\\(s\\) 'label'"):
        fmt.encode({"prompt": "p", "completion": "c"}, tokenizer, template, where="k.jsonl, line 4")


def test_bundled_dataset_is_the_generator_output_and_scores_right():
    from toolkit_dpo import synthetic

    train, held_out = synthetic.split()
    for name, rows in (("parity-prefs", train), ("parity-prefs-eval", held_out)):
        shipped = [json.loads(line) for line in (synthetic.ASSETS / f"{name}.jsonl").read_text().splitlines()]
        assert shipped == rows
        assert all(synthetic.score(r["prompt"], r["chosen"]) and not synthetic.score(r["prompt"], r["rejected"])
                   for r in shipped)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}


def test_pipeline_keeps_pairs_together_and_dpo_starts_at_log2(tokenizer):
    import math

    import torch

    from toolkit.data.pipeline import Batches, load_examples
    from toolkit.plugins import get_plugin_manager
    from toolkit_dpo.functional import pair_indices
    from toolkit_dpo.losses import DPOLoss

    manager = get_plugin_manager()
    assert "parity-prefs" in manager.get("dataset_format", "preference").bundled_datasets
    examples, _ = load_examples(["parity-prefs"], tokenizer, max_samples=40, example_kinds=DPOLoss.example_kinds)
    batches = Batches(examples, seed=0, seq_len=128, packing=True, micro_batch_size=2, global_batch_size=4,
                      dp_rank=0, dp_world_size=1, pad_id=tokenizer.pad_token_id)
    ctx = batches.context(0)
    assert ctx.examples > 4 and ctx.sequences == 2 * ctx.examples  # packed rows hold several pairs
    assert 0 < ctx.counts["chosen_label_tokens"] < ctx.label_tokens
    for batch in batches.micro_batches(0):
        chosen, rejected = pair_indices(batch["sequence_meta"])
        assert chosen.numel() == rejected.numel() > 0
        from toolkit.contracts import TokenLogps

        mask = batch["labels"] != IGNORE_INDEX
        logps = torch.where(mask, torch.full(mask.shape, -0.5), torch.zeros(mask.shape))
        out = TokenLogps(logps=logps, mask=mask, sequence_ids=batch["sequence_ids"], num_sequences=batch["num_sequences"],
                         sequence_meta=batch["sequence_meta"], reference_logps=None)
        out.reference_logps = out.sequence_sums()
        assert float(DPOLoss()(out, ctx).loss) == pytest.approx(math.log(2) * chosen.numel() / ctx.examples)


def test_registration_cli_and_shared_kto_section():
    from click.testing import CliRunner

    from toolkit.cli import build_cli
    from toolkit.plugins import get_plugin_manager
    from toolkit.recipe import resolve_recipe

    manager = get_plugin_manager()
    for name in ("dpo", "ipo", "hinge", "kto", "simpo", "orpo", "cpo", "rm"):
        assert manager.registry("loss").owner(name) == "dpo"
    cli = build_cli()
    for name in ("dpo", "kto", "simpo", "orpo", "cpo"):
        assert name in cli.commands
    result = CliRunner().invoke(cli, ["plugins"])
    assert "toolkit-dpo" in result.output
    recipe = resolve_recipe({"loss": "kto", "dataset": ["x.jsonl"], "kto": {"beta": 0.2, "kl": False}})
    fmt_cls = manager.get("dataset_format", "kto")
    assert fmt_cls(fmt_cls.Config(**recipe.options["kto"])).config.kl is False
