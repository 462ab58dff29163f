"""Evaluation of the model a run stands for: the algorithm's consensus model on the test set
(and the validation split, if held out), split across processes with the sums combined, so
evaluation costs each process 1/P of the test set (in an asynchronous run on processes the main
process evaluates alone); with an algorithm whose workers hold different models, also every
worker's own model.

`train.eval_bn_stats` chooses the float buffers (BatchNorm's running statistics) the consensus
model is evaluated with: `consensus` (default) the algorithm's own (`Algorithm.consensus`:
worker 0's for `sync`, as DDP broadcasts them; the workers' mean for the gossip and local
methods), `average` the element-wise mean of every worker's float buffers (running_mean and
running_var each averaged arithmetically, as gossip's consensus averages them: the mean of
the workers' variances, which leaves out the spread between the workers' means), `recompute`
every BatchNorm layer's statistics recomputed on one training batch (see `recompute_bn`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dpresearch.comm.ledger import EVAL
from dpresearch.run.build import Run

BN_STATS = ("consensus", "average", "recompute")


@torch.no_grad()
def recompute_bn(model: nn.Module, inputs: Tensor) -> nn.Module:
    """Replace every BatchNorm layer's running statistics in `model` by those of one forward
    pass over `inputs` in training mode: each layer's running_mean the batch mean of its input,
    running_var the unbiased batch variance (what `torch.optim.swa_utils.update_bn` computes
    with one batch). Other buffers and the parameters are left; `model` is returned in eval
    mode."""
    layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in layers]
    for m in layers:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after one batch, that batch's statistics
    model.train()
    model(inputs)
    for m, momentum in zip(layers, momenta, strict=True):
        m.momentum = momentum
    return model.eval()


class Evaluator:
    """Evaluates `run` (see the module docstring)."""

    def __init__(self, run: Run) -> None:
        self.run = run

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        """`test/loss`, `test/acc` (and `val/…`) of the consensus model; with local models,
        `test/acc_local_mean` and `_min` over every worker's own model."""
        run = self.run
        comm = run.comm
        params, buffers = run.algorithm.consensus()
        mode = run.cfg.train.eval_bn_stats
        if mode == "average":
            every = run.replicas.buffers.clone()
            comm.all_reduce(every, op="mean", record=EVAL)
            buffers = every[0]
        model = run.replicas.load_into(run.eval_model, params, buffers)
        if mode == "recompute":
            with run.compute.autocast():
                recompute_bn(model, self.bn_batch())
        # lockstep: each process 1/P of the test set, the sums combined; otherwise all here
        part, parts = (0, 1)
        if run.lockstep:
            part, parts = comm.local_workers[0] // comm.num_local, run.processes
        splits = ["test"] + (["val"] if run.data.val_targets is not None else [])
        sums = torch.zeros(comm.num_local, 3 * len(splits), dtype=torch.float64, device=run.device)
        for i, split in enumerate(splits):
            sums[0, 3 * i : 3 * i + 3] = self.sums(model, part, parts, split)
        if run.lockstep:
            comm.all_reduce(sums, op="sum", record=EVAL)
        result = {}
        for i, split in enumerate(splits):
            loss, correct, count = sums[0, 3 * i : 3 * i + 3].tolist()
            result[f"{split}/loss"] = loss / count
            result.update(run.data.split_metrics(split, loss / count))
            if run.data.classification:  # a regression data set has a loss only
                result[f"{split}/acc"] = correct / count
        if run.algorithm.evaluates_local_models:
            # Each worker's model lives only where the worker does: it sees the whole test set.
            accs = torch.stack([self.sums(m, 0, 1)[1:] for m in run.replicas.models])
            accs = accs[:, :1] / accs[:, 1:]
            accs = (comm.all_gather(accs, record=EVAL) if run.lockstep else accs)[:, 0]
            result["test/acc_local_mean"] = accs.mean().item()
            result["test/acc_local_min"] = accs.min().item()
        run.replicas.train()
        return result

    def bn_batch(self) -> Tensor:
        """The model inputs `recompute` takes its statistics from: the first
        `train.eval_batch_size` examples of the training split (stored order, test-time
        transform), the same at every evaluation and on every process."""
        data, size = self.run.data, self.run.cfg.train.eval_batch_size
        return self.run.compute.laid_out(data.transform_test(data.train_inputs[:size]))

    def sums(self, model: nn.Module, part: int, parts: int, split: str = "test") -> Tensor:
        """(summed loss, correct, count) of `model` on shard `part` of `parts` of `split`."""
        run, tc = self.run, self.run.cfg.train
        was_training = model.training
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=run.device)
        for x, y in run.data.test_batches(tc.eval_batch_size, part, parts, split):
            with run.compute.autocast():
                out = model(run.compute.laid_out(x)).float()
            sums[0] += run.data.loss(out, y, reduction="sum").double()
            if run.data.classification:
                sums[1] += run.data.hits(out, y).sum().double()
            sums[2] += y.shape[0]  # examples: `loss` sums one mean per example
        model.train(was_training)
        return sums
