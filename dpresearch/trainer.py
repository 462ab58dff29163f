"""The training loop, the same for every algorithm and every worker layout.

Per step: each local worker takes its shard of the global batch (the partitioner decides which
examples), runs forward and backward into its row of the flat gradient buffer, then the
algorithm does what it does between backward and the next forward. Evaluation and the final
checkpoint use the algorithm's consensus model; the test set is split across processes and the
sums combined, so evaluation costs each process 1/P of the test set.
"""

from __future__ import annotations

import copy
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from torch import nn

from dpresearch.comm.base import Communicator
from dpresearch.data.base import Dataset
from dpresearch.optim import make_optimizer, set_lr
from dpresearch.progress import format_progress, format_setup
from dpresearch.replicas import Replicas
from dpresearch.run_logger import NullLogger, RunLogger


class InjectedFailure(RuntimeError):
    """Raised by `debug.fail_worker` / `debug.fail_at_step` to test failure handling."""


def worker_seed(seed: int, worker: int) -> int:
    """Seed of worker `worker`'s own generator (augmentation, sampling in compressors)."""
    return (seed * 1_000_003 + 7919 * (worker + 1)) % (2**63 - 1)


class Trainer:
    """Builds everything from `cfg` for the workers this process holds and runs the loop."""

    def __init__(
        self,
        cfg: DictConfig,
        comm: Communicator,
        device: torch.device,
        run_dir: Path | None,
        dataset: Dataset | None = None,
    ) -> None:
        self.cfg, self.comm, self.device = cfg, comm, device
        k, tc = cfg.workers, cfg.train
        torch.manual_seed(cfg.seed)
        self.data: Dataset = (
            dataset.to(device) if dataset is not None else instantiate(cfg.data, device=str(device))
        )
        self.partitioner = self.data.make_partitioner(k, cfg.seed)
        self.steps_per_epoch = self.partitioner.samples_per_worker // tc.batch_size
        if self.steps_per_epoch < 1:
            raise ValueError(
                f"train.batch_size={tc.batch_size} is larger than the "
                f"{self.partitioner.samples_per_worker} examples each of {k} workers holds; "
                "lower train.batch_size or workers"
            )
        self.total_steps = tc.steps or max(1, math.ceil(tc.epochs * self.steps_per_epoch))

        torch.manual_seed(cfg.seed)
        model: nn.Module = instantiate(
            cfg.model, num_classes=self.data.num_classes, input_shape=self.data.input_shape
        )
        self.replicas = Replicas(model, comm.num_local, device, tc.channels_last)
        # Replicas built from one seed are identical, but broadcasting worker 0's state makes
        # that true even where initialisation draws differ between processes.
        comm.broadcast(self.replicas.params, src=0, record=False)
        comm.broadcast(self.replicas.buffers, src=0, record=False)
        self.eval_model = copy.deepcopy(model).to(device)

        lr_scale = float(k) if tc.lr_scaling == "linear" else 1.0
        self.optimizers = [make_optimizer(cfg.optimizer, m, lr_scale) for m in self.replicas.models]
        self.base_lrs = [[g["lr"] for g in opt.param_groups] for opt in self.optimizers]
        self.schedule = instantiate(
            cfg.schedule, steps_per_epoch=self.steps_per_epoch, total_steps=self.total_steps
        )
        self.algorithm = instantiate(
            cfg.algorithm, replicas=self.replicas, comm=comm, optimizers=self.optimizers
        )
        self.generators = [
            torch.Generator().manual_seed(worker_seed(cfg.seed, w)) for w in comm.local_workers
        ]
        resolved = OmegaConf.to_container(cfg, resolve=True)
        self.logger = (
            RunLogger(run_dir, resolved, cfg.logger) if run_dir is not None else NullLogger()
        )
        self.loss_scale = float(tc.loss_scale) if tc.autocast == "fp16" else 1.0
        self.setup = self.algorithm.describe()
        if self.setup and comm.is_main_process and tc.progress:
            print(format_setup(self.setup), flush=True)
        self.comm.ledger.reset()

    def _autocast(self):
        """Mixed precision for the forward pass (and, through autograd, the backward)."""
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
        enabled = self.cfg.train.autocast in dtypes
        return torch.autocast(
            self.device.type,
            dtype=dtypes.get(self.cfg.train.autocast, torch.bfloat16),
            enabled=enabled,
        )

    # -- evaluation ---------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Test loss and accuracy of the consensus model over the whole test set; with an
        algorithm whose workers hold different models, also the mean and the minimum of
        every worker's own test accuracy."""
        params, buffers = self.algorithm.consensus()
        model = self.replicas.load_into(self.eval_model, params, buffers)
        num_processes = self.comm.world_size // self.comm.num_local
        process_index = self.comm.local_workers[0] // self.comm.num_local
        sums = torch.zeros(self.comm.num_local, 3, dtype=torch.float64, device=self.device)
        sums[0] = self._test_sums(model, process_index, num_processes)
        self.comm.all_reduce(sums, op="sum", record=False)
        loss, correct, count = sums[0].tolist()
        result = {"test/loss": loss / count, "test/acc": correct / count}
        if self.algorithm.evaluates_local_models:
            # Each worker's model lives only where the worker does: it sees the whole test set.
            accs = (
                torch.stack([self._test_sums(m, 0, 1) for m in self.replicas.models])[:, 1:2]
                / count
            )
            accs = self.comm.all_gather(accs, record=False)[:, 0]
            result["test/acc_local_mean"] = accs.mean().item()
            result["test/acc_local_min"] = accs.min().item()
        return result

    def _test_sums(self, model: nn.Module, part: int, parts: int) -> torch.Tensor:
        """(summed loss, correct, count) of `model` on test shard `part` of `parts`."""
        was_training = model.training
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for x, y in self.data.test_batches(self.cfg.train.eval_batch_size, part, parts):
            if self.cfg.train.channels_last and x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
            with self._autocast():
                out = model(x).float()
            sums[0] += F.cross_entropy(out, y, reduction="sum").double()
            sums[1] += (out.argmax(1) == y).sum().double()
            sums[2] += y.numel()
        model.train(was_training)
        return sums

    def _bytes_per_worker(self) -> tuple[float, float]:
        """(mean, max) over all K workers of the bytes each has sent (unrecorded gather)."""
        mine = torch.tensor(
            self.comm.ledger.bytes_by_worker, dtype=torch.float64, device=self.device
        ).unsqueeze(1)
        every = self.comm.all_gather(mine, record=False)
        return every.mean().item(), every.max().item()

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg, tc, comm = self.cfg, self.cfg.train, self.comm
        k, batch = cfg.workers, tc.batch_size
        eval_every = tc.eval_every or self.steps_per_epoch
        window = torch.zeros(comm.num_local, 3, dtype=torch.float64, device=self.device)
        compute_s, start = 0.0, time.perf_counter()
        last: dict[str, Any] = {}
        best_acc = 0.0
        indices: list[torch.Tensor] = []
        self.replicas.train()
        for step in range(self.total_steps):
            epoch, pos = divmod(step, self.steps_per_epoch)
            if pos == 0:
                indices = [self.partitioner.epoch_indices(w, epoch) for w in comm.local_workers]
            multiplier = self.schedule(step)
            for opt, bases in zip(self.optimizers, self.base_lrs, strict=True):
                set_lr(opt, bases, multiplier)

            step_start, comm_before = time.perf_counter(), comm.ledger.measured_s
            self.algorithm.before_forward(step)
            self.replicas.zero_grad()
            for w, model in enumerate(self.replicas.models):
                x, y = self.data.train_batch(
                    indices[w][pos * batch : (pos + 1) * batch], self.generators[w]
                )
                if tc.channels_last and x.dim() == 4:
                    x = x.contiguous(memory_format=torch.channels_last)
                with self._autocast():
                    out = model(x)
                    loss = F.cross_entropy(out, y)
                (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
                with torch.no_grad():
                    window[w, 0] += loss.double()
                    window[w, 1] += (out.argmax(1) == y).double().mean()
                    window[w, 2] += 1
            self._maybe_fail(step)
            if self.loss_scale != 1.0:
                self.replicas.grads.div_(self.loss_scale)
            self.algorithm.after_backward(step)
            step_comm = comm.ledger.measured_s - comm_before
            compute_s += time.perf_counter() - step_start - step_comm

            done = step + 1
            is_last = done == self.total_steps
            if done % tc.log_every == 0 or done % eval_every == 0 or is_last:
                comm.all_reduce(window, op="sum", record=False)
                loss_sum, acc_sum, count = window[0].tolist()
                window.zero_()
                bytes_mean, bytes_max = self._bytes_per_worker()
                last = {
                    "step": done,
                    "epoch": done / self.steps_per_epoch,
                    "samples": done * k * batch,
                    "train/loss": loss_sum / count,
                    "train/acc": acc_sum / count,
                    "lr": self.optimizers[0].param_groups[0]["lr"],
                    "comm/bytes": bytes_mean,
                    "comm/bytes_max": bytes_max,
                    "comm/modeled_s": comm.ledger.modeled_s,
                    "time/compute_s": compute_s,
                    "time/comm_s": comm.ledger.measured_s,
                    "time/wall_s": time.perf_counter() - start,
                }
                last.update(self.algorithm.metrics())
                if done % eval_every == 0 or is_last:
                    last.update(self.evaluate())
                    best_acc = max(best_acc, last["test/acc"])
                    self.replicas.train()
                self.logger.log(last)
                if tc.progress and comm.is_main_process:
                    print(format_progress(last, self.total_steps), flush=True)

        summary = dict(last)
        summary.update(
            {
                "best/test_acc": best_acc,
                "steps_per_epoch": self.steps_per_epoch,
                "total_steps": self.total_steps,
                "num_params": self.replicas.num_params,
                "comm/bytes_per_epoch": last["comm/bytes"]
                / (self.total_steps / self.steps_per_epoch),
                "comm/op_counts": dict(comm.ledger.op_counts),
                "comm/ops": comm.ledger.op_table(),
                **self.setup,
            }
        )
        if isinstance(self.logger, RunLogger) and tc.save_model:
            torch.save(self.eval_model.state_dict(), self.logger.run_dir / "model_final.pt")
        self.logger.finish(summary)
        return summary

    def _maybe_fail(self, step: int) -> None:
        dbg = self.cfg.debug
        if dbg.fail_at_step == step and dbg.fail_worker in self.comm.local_workers:
            raise InjectedFailure(f"injected failure on worker {dbg.fail_worker} at step {step}")
