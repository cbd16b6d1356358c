"""Packed rows through FlexAttention in the megatron core attention equal the dense-mask path."""

from __future__ import annotations

import pytest
import torch

from toolkit.testing import packed_batch


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2)])
def test_flex_packed_attention_equals_the_dense_mask(tp1, tiny_models, heads, groups):
    from transformers import AutoConfig

    from toolkit.parallel import ParallelLayout
    from toolkit_megatron.attention import SDPAAttention, document_mask
    from toolkit_megatron.model import transformer_config

    hf_config = AutoConfig.from_pretrained(tiny_models["llama"])
    config = transformer_config(hf_config, ParallelLayout(), torch.float32)
    from megatron.core.transformer.enums import AttnMaskType

    dense = SDPAAttention(config, 1, AttnMaskType.causal, "self", packed_flex=False)
    flex = SDPAAttention(config, 1, AttnMaskType.causal, "self", packed_flex=True)
    batch = packed_batch([[5, 7, 4], [16], [9]], 16, vocab=64)  # three packed samples, a full row, a padded row
    meta = torch.stack([batch["position_ids"], batch["sequence_ids"]])
    torch.manual_seed(0)
    query = torch.randn(16, 3, heads, 8)
    key, value = torch.randn(16, 3, groups, 8), torch.randn(16, 3, groups, 8)
    expected = dense._forward(query, key, value, meta)
    got = flex._forward(query, key, value, meta)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)  # padding attends to itself in both: all positions
    # one mask for the tensor every layer sees, a new one for the next micro-batch's tensor
    assert document_mask(meta) is document_mask(meta)
    assert document_mask(meta.clone()) is not document_mask(meta)


@pytest.mark.parametrize(("window", "cap"), [(4, 3.0), (4, None), (None, 3.0)], ids=["window+softcap", "window", "softcap"])
@pytest.mark.parametrize("packed", [False, True])
def test_flex_windows_and_soft_capping_equal_the_dense_path(tp1, window, cap, packed):
    """The core attention of Gemma 2's layers (window, soft-capping) and Gemma 3's window layers with
    ``--megatron-packed-attention flex`` against the dense path (``sdpa-mask``), on plain and packed rows."""
    from megatron.core.transformer.enums import AttnMaskType

    from conftest import tiny_config
    from toolkit.parallel import ParallelLayout
    from toolkit_megatron.attention import SDPAAttention
    from toolkit_megatron.model import transformer_config

    config = transformer_config(tiny_config("gemma2"), ParallelLayout(), torch.float32)
    built = {flex: SDPAAttention(config, 1, AttnMaskType.causal, "self", sliding_window=window, softcap=cap, packed_flex=flex)
             for flex in (False, True)}
    batch = packed_batch([[5, 7, 4], [16], [9]], 16, vocab=64)
    meta = torch.stack([batch["position_ids"], batch["sequence_ids"]]) if packed else None
    torch.manual_seed(0)
    query, key, value = torch.randn(16, 3, 4, 32) * 3, torch.randn(16, 3, 2, 32) * 3, torch.randn(16, 3, 2, 32)
    expected = built[False]._forward(query, key, value, meta)
    torch.testing.assert_close(built[True]._forward(query, key, value, meta), expected, rtol=1e-5, atol=1e-5)
