"""GPU probe: what PyTorch's cuDNN varlen attention returns, and whether its backward can be
called from Python (``backends/cudnn.BACKWARD_REACHABLE``). On torch 2.11 (H100) every lse
layout failed the same way: ``attn_bias`` is a required Tensor and an empty one is read as a
bias (``Dimension out of range``).

    python3 benchmarks/gpu_probe_cudnn.py
"""

import torch


def main() -> None:
    h, d, n = 8, 64, 70
    cq = torch.tensor([0, 50, n], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fwd = torch.ops.aten._cudnn_attention_forward
    res = fwd(q, k, v, None, cq, cq, 50, 50, True, 0.0, False, False, scale=0.125)
    shapes = [(tuple(r.shape), r.dtype) if isinstance(r, torch.Tensor) else r for r in res]
    print("forward outputs:", shapes)
    out, lse = res[0], res[1]
    seed = torch.zeros((), dtype=torch.int64, device="cuda")
    no_bias = torch.empty(0, device="cuda", dtype=q.dtype)
    flat = lse.reshape(-1)[: n * h]
    layouts = {"as returned": lse, "[H,N,1]": flat.view(n, h).t().contiguous().unsqueeze(-1),
               "[N,H,1]": flat.view(n, h, 1).contiguous()}  # fmt: skip
    for name, lse_x in layouts.items():
        try:
            grads = torch.ops.aten._cudnn_attention_backward(
                torch.randn_like(out), q, k, v, out, lse_x, seed, seed, no_bias, cq, cq, 50, 50, 0.0, False,
                scale=0.125,
            )  # fmt: skip
            print(name, "ok", [tuple(g.shape) for g in grads])
        except RuntimeError as exc:
            print(name, "ERROR", str(exc)[:300])
        except IndexError as exc:
            print(name, "ERROR", str(exc)[:300])


if __name__ == "__main__":
    main()
