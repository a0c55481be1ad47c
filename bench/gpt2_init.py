"""GPT-2's initialization for the benchmarks' transformer LMs."""

import torch


def gpt2_init(model: torch.nn.Module, layers: int) -> None:
    """Weights N(0, 0.02), the residual projections' (modules named ``proj`` and ``down``)
    N(0, 0.02 / sqrt(2 layers)), biases 0, LayerNorms as torch makes them. torch's defaults,
    N(0, 1) embeddings under a tied head, put the logits' std near sqrt(width): a saturated
    softmax whose head gradient is exactly 0 for all but a token or two a position, and
    gradients of exact zeros that no trained model has."""
    for name, m in model.named_modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            std = 0.02 / (2 * layers) ** 0.5 if name.endswith((".proj", ".down")) else 0.02
            torch.nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                torch.nn.init.zeros_(m.bias)
