"""Use tritonllm's Triton kernels in your own PyTorch model.

Every function of ``tritonllm.kernels`` is differentiable (a ``torch.autograd.Function`` whose
forward and backward are Triton kernels) and takes ordinary tensors, so it drops into any
``nn.Module``. Here: a pre-norm attention block and a SwiGLU MLP built from ``rms_norm``,
``linear``, ``rope``, ``flash_attention`` and ``swiglu``, trained for a few steps to fit random
targets. Runs on a CUDA GPU, or on the CPU through Triton's interpreter (slowly, small shapes).

    python examples/use_kernel_in_your_model.py
"""

import torch
from torch import nn

from tritonllm.kernels import flash_attention, linear, rms_norm, rope, rope_cos_sin, swiglu


class MyBlock(nn.Module):
    def __init__(self, dim: int = 128, n_heads: int = 4, hidden: int = 256, max_len: int = 256):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.norm1, self.norm2 = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.qkv = nn.Parameter(torch.randn(3 * dim, dim) * 0.02)
        self.out = nn.Parameter(torch.randn(dim, dim) * 0.02)
        self.up = nn.Parameter(torch.randn(2 * hidden, dim) * 0.02)  # [gate; up] rows
        self.down = nn.Parameter(torch.randn(dim, hidden) * 0.02)
        cos, sin = rope_cos_sin(max_len, self.head_dim)  # fp32 [max_len, head_dim / 2]
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x):  # x [B, T, dim]
        B, T, D = x.shape
        q, k, v = linear(rms_norm(x, self.norm1), self.qkv).view(B, T, 3 * self.n_heads, self.head_dim).chunk(3, dim=2)
        q, k = rope(q, self.cos, self.sin), rope(k, self.cos, self.sin)
        x = linear(flash_attention(q, k, v, causal=True).reshape(B, T, D), self.out, residual=x)
        h = swiglu(linear(rms_norm(x, self.norm2), self.up))  # silu(gate) * up over the packed [..., 2 * hidden]
        return linear(h, self.down, residual=x)


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(MyBlock(), MyBlock()).to(device)
    x = torch.randn(2, 64, 128, device=device)
    target = torch.randn(2, 64, 128, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(10):
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
