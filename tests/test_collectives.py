"""The autograd collectives (rlflow/parallel/collectives.py) on 2 gloo processes, forward and backward,
against the values they must give (exact). Fast: one process start."""

import torch

from rlflow.runtime.launch import spawn


def collectives_check(rank: int, world: int) -> dict[str, float]:
    """all_gather / reduce_scatter / all_to_all forward and backward on 2 ranks against the values they
    must give (losses summed over ranks: each rank's loss is its own term)."""
    import torch.distributed as dist

    from rlflow.device import process_device
    from rlflow.parallel import collectives as C
    dev = process_device()
    g = dist.group.WORLD
    X = torch.arange(12., device=dev).view(4, 3)
    W = [torch.linspace(-1, 1, 12, device=dev).view(4, 3) * (r + 1) for r in range(2)]  # rank r's loss weights
    err = {}
    x = X[2 * rank:2 * rank + 2].clone().requires_grad_(True)  # sharded(0)
    y = C.all_gather(x, 0, g)
    (y * W[rank]).sum().backward()
    want_grad = (W[0] + W[1])[2 * rank:2 * rank + 2]  # both ranks' losses use the gathered rows
    err["all_gather"] = max(float((y.detach() - X).abs().max()), float((x.grad - want_grad).abs().max()))
    x = (X * (rank + 1)).requires_grad_(True)  # partial: the value is 3 X
    y = C.reduce_scatter(x.transpose(0, 1), 1, g).transpose(0, 1)  # along dim 1 of the transposed view
    (y * W[rank][2 * rank:2 * rank + 2]).sum().backward()
    err["reduce_scatter"] = max(float((y.detach() - 3 * X[2 * rank:2 * rank + 2]).abs().max()),
                                float((x.grad - torch.cat([W[0][:2], W[1][2:]])).abs().max()))
    ins = [[1, 3], [2, 0]][rank]  # rank 0 sends 1 row to itself, 3 to rank 1; rank 1 sends 2 to rank 0
    outs = [[1, 2], [3, 0]][rank]
    x = (torch.arange(4., device=dev)[:sum(ins), None] + 10 * rank).repeat(1, 3).requires_grad_(True)
    y = C.all_to_all(x, outs, ins, g)
    want = [torch.tensor([0., 10., 11.]), torch.tensor([1., 2., 3.])][rank].to(dev)
    (0.5 * y.square()).sum().backward()  # d/dy = y, so each row's gradient comes back to its sender as itself
    err["all_to_all"] = max(float((y.detach()[:, 0] - want).abs().max()), float((x.grad - x.detach()).abs().max()))
    x = X.clone().requires_grad_(True)  # replicated, used partially: the gradient sums the ranks' parts
    y = C.copy_to(x, g)
    (y * W[rank]).sum().backward()
    err["copy_to"] = max(float((y.detach() - X).abs().max()), float((x.grad - (W[0] + W[1])).abs().max()))
    x = (X * (rank + 1)).requires_grad_(True)  # partial -> replicated 3 X; backward: the identity
    y = C.reduce_from(x, g)
    (y * W[rank]).sum().backward()
    err["reduce_from"] = max(float((y.detach() - 3 * X).abs().max()), float((x.grad - W[rank]).abs().max()))
    return err




def test_collectives_forward_and_backward_on_two_ranks():
    results = spawn(collectives_check, 2)
    for rank, errs in enumerate(results):
        assert set(errs) == {"all_gather", "reduce_scatter", "all_to_all", "copy_to", "reduce_from"}
        assert all(e == 0 for e in errs.values()), (rank, errs)
