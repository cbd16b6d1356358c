"""The MoE aux loss: the plain HF model's is transformers' own for one MoE layer; a patched model owns its loss, the engines
hand its pop the real tokens, and a pop without that parameter still works."""

from __future__ import annotations

import torch
from torch import nn

from toolkit.train.logps import router_aux_loss


class Patched(nn.Module):
    def __init__(self, pop):
        super().__init__()
        self.toolkit_pop_aux_loss = pop


def test_pop_gets_the_real_tokens_flattened():
    seen = []

    def pop(tokens=None):
        seen.append(tokens)
        return torch.tensor(0.5), {"moe_aux_loss": torch.tensor(2.0)}

    sequence_ids = torch.tensor([[0, 0, 1], [0, -1, -1]])
    loss, metrics = router_aux_loss(Patched(pop), None, sequence_ids)
    assert float(loss) == 0.5 and metrics == {"moe_aux_loss": 2.0}
    assert torch.equal(seen[0], torch.tensor([True, True, True, True, False, False]))


def test_pop_without_a_tokens_parameter_is_called_without_it():
    loss, metrics = router_aux_loss(Patched(lambda: (torch.tensor(0.25), {})), None, torch.tensor([[0, -1]]))
    assert float(loss) == 0.25 and metrics == {}


def test_plain_hf_loss_of_one_moe_layer_is_transformers_own() -> None:
    """With one MoE layer the per-layer mean the toolkit trains (docs/moe.md) is transformers' ``aux_loss`` of the
    model's own forward, padding left out; with more layers transformers pools the layers, which no per-layer
    engine can compute, so one layer is where the two definitions meet."""
    import transformers

    from toolkit.train.logps import CausalLMLogps

    config = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=8,
                                         num_experts_per_tok=2, moe_intermediate_size=24, router_aux_loss_coef=0.3)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)  # spread router logits, so an unbalanced routing has a large loss
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))
    sequence_ids = torch.zeros_like(ids)
    sequence_ids[1, 6:] = -1
    labels = ids.masked_fill(sequence_ids < 0, -100)
    aux = CausalLMLogps(model)(ids, labels, torch.arange(10).expand(2, 10), sequence_ids)[1]
    reference = model(input_ids=ids, attention_mask=(sequence_ids >= 0).long(), output_router_logits=True).aux_loss.detach()
    torch.testing.assert_close(aux.detach(), 0.3 * reference, rtol=1e-6, atol=0)
