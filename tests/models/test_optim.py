"""make_adamw: torch's fused AdamW where the device has the kernel, and `is_fused` saying so."""

import torch

from lmppo.models.optim import is_fused, make_adamw


def test_adamw_is_fused_on_cpu_and_steps_like_the_plain_one():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    fused = make_adamw(list(a.parameters()), 1e-2, 1e-8, 0.1)
    plain = torch.optim.AdamW(list(b.parameters()), lr=1e-2, eps=1e-8, weight_decay=0.1)
    assert is_fused(fused) and not is_fused(plain)
    x = torch.randn(5, 4)
    for _ in range(3):
        for model, opt in ((a, fused), (b, plain)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    assert torch.allclose(a.weight, b.weight, atol=1e-6)
