import torch

from rlflow import optim


def test_adamw_matches_torch_adamw():
    torch.manual_seed(0)
    shapes = {"w": (5, 4), "b": (4,)}
    params = {k: torch.randn(s) for k, s in shapes.items()}
    ref = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    cfg = optim.AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    # torch applies decay to every parameter; decay only the matrix to match our rule
    topt = torch.optim.AdamW([{"params": [ref["w"]], "weight_decay": 0.1},
                              {"params": [ref["b"]], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    state = optim.init(params)
    for i in range(5):
        grads = {k: torch.randn(s) for k, s in shapes.items()}
        params, state = optim.step(params, grads, state, cfg)
        for k in ref:
            ref[k].grad = grads[k].clone()
        topt.step()
    for k in params:
        torch.testing.assert_close(params[k], ref[k].detach(), rtol=1e-6, atol=1e-6)
    assert state.step == 5


def test_clip_by_global_norm():
    g = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}
    clipped, norm = optim.clip_by_global_norm(g, 1.0)
    assert abs(norm.item() - 5.0) < 1e-6
    assert abs(optim.global_norm(clipped).item() - 1.0) < 1e-5
    same, _ = optim.clip_by_global_norm(g, 10.0)
    assert torch.equal(same["a"], g["a"])
