"""The MoE aux loss a patched model owns: the engines hand its pop the real tokens, and a pop without that parameter still works."""

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
