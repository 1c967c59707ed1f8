"""The Trainer: a plain training loop with every speed practice on, readable top to bottom.

fetch (timed) -> device (prefetched) -> autocast forward -> scaled backward -> unscale -> clip ->
step -> zero_grad(set_to_none) -> schedule -> log every `log_every` steps. Nothing in a step waits
for the device: the loss is summed on the device and read only at log points.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainfast.device import resolve_device, synchronize
from trainfast.envcheck.environment import checkpoint_preflight, preflight
from trainfast.flops import FlopCounter, Peak, Utilisation, peak_flops, precision_of, utilisation
from trainfast.host import available_cpus
from trainfast.loader.auto import threads_beside_workers
from trainfast.loader.seeding import seed_all
from trainfast.monitor import Monitor
from trainfast.oom import advice, first_line, is_oom, memory_at_oom
from trainfast.precision.policy import LossScaler, PrecisionPolicy, ScaleWatch, device_caps, resolve_precision
from trainfast.samples import batch_samples
from trainfast.trainer.callbacks import check_callbacks, emit
from trainfast.trainer.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    clean_stale_temps,
    copy_best,
    estimate_checkpoint_bytes,
    kept_bytes,
    load_checkpoint,
    load_latest_good,
    rng_state,
    save_checkpoint,
    set_rng_state,
    versions,
)
from trainfast.trainer.clock import StepClock
from trainfast.trainer.config import ConfigError, TrainConfig
from trainfast.trainer.distributed import (
    all_max,
    all_sum,
    barrier,
    dist_info,
    dist_initialized,
    gather,
    process_group,
)
from trainfast.trainer.feeding import batches_per_epoch, check_sharding, closing, position, prefetch
from trainfast.trainer.optimizer import default_optimizer
from trainfast.trainer.practices import Practices, resolve_channels_last
from trainfast.trainer.progress import ProgressReporter
from trainfast.trainer.result import FitResult
from trainfast.trainer.schedule import warmup_cosine
from trainfast.trainer.settings import torch_settings
from trainfast.trainer.signals import EXIT_CODE, StopSchedule, StopSignal, parse_signals, workers_ignore
from trainfast.trainer.step import LossOf, forward_backward, optimizer_step, renamed_step_fn

log = logging.getLogger("trainfast")
_SYNCED = nullcontext()  # reusable: no object built per step
RATE_WINDOW = 50  # steps over which the progress display averages samples/s and data wait


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite; no checkpoint was written after it did."""


class TrainingOutOfMemoryError(torch.OutOfMemoryError):
    """Memory ran out inside `fit`: where, what the allocator held, what to change. No checkpoint was written
    after it (the last one is intact); the original error is its `__cause__`."""


class Trainer:
    """Train `model` with AdamW + warm-up cosine (unless given an optimizer) and cross-entropy (unless given a loss).

    A batch is `(inputs, targets)`; for anything else pass `batch_loss(model, batch) -> loss`.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 config: TrainConfig | None = None, callbacks: Sequence[object] = (), *,
                 batch_loss: LossOf | None = None, step_fn: LossOf | None = None) -> None:
        self.config = cfg = config or TrainConfig()
        check_callbacks(callbacks)
        self.callbacks = list(callbacks)
        try:
            self.dist = dist_info()  # torchrun's RANK / LOCAL_RANK / WORLD_SIZE, or a single process (srun refused)
            self.device = resolve_device(cfg.device)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        caps = device_caps(self.device)
        precision = resolve_precision(cfg.precision, caps)
        channels_last = resolve_channels_last(cfg.channels_last, model, self.device,
                                              precision.autocast_dtype is not None)
        fmt = torch.channels_last if channels_last else torch.preserve_format
        self.model: nn.Module = model.to(self.device, memory_format=fmt)  # type: ignore[call-overload]
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optimizer or default_optimizer(self.model, cfg.lr, cfg.weight_decay, self.device)
        # precision, channels_last and compile: priors now, confirmed by A/Bs on the first steps of fit
        self.practices = Practices(self.model, self.optimizer, self.device, caps, precision, channels_last,
                                   requested_precision=cfg.precision, requested_channels_last=cfg.channels_last,
                                   requested_compile=cfg.compile)
        # MFU's peak is the settled precision's; taken in the loop, its time is left out of the step it falls in
        self.practices.on_settled = lambda: self.clock.leave_out(self._take_peak())
        self.loss_fn = loss_fn or F.cross_entropy
        self.batch_loss = renamed_step_fn(batch_loss, step_fn)
        self.scaler = LossScaler(self.device, precision.needs_scaler, cfg.scaler)
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.clock = StepClock()
        self.epoch = self.step = self.batch = 0  # position: next epoch / optimizer steps done / next batch
        self.best_metric: float | None = None
        self._loss_sum, self._loss_count = torch.zeros((), device=self.device), 0  # since the last read
        self._epoch_loss = [0.0, 0]  # sum, batches: the host side, folded in at log points
        self.last_loss: float | None = None  # mean training loss at the last read
        self.last_metrics: dict[str, float] = {}  # train_loss, val_loss, val_accuracy of the last epoch
        self._skipped_seen = 0
        self._window_from_step = 0  # optimizer step at which the loss window being summed began
        self.scale_watch = ScaleWatch(bf16_here=caps.bf16)
        self.last_loss_scale: float | None = None
        self._ddp: DistributedDataParallel | None = None
        self._stop_schedule = StopSchedule()
        self._alone = True  # no other rank to agree with (set by fit)
        self._saved_practices: dict[str, str] | None = None  # what the run a checkpoint resumes chose
        # MFU: one batch's FLOPs (counted once per Trainer, on a warm-up step) and the peak (once per fit)
        self._flops: int | None = None
        self._flops_samples = 0
        self._peak: Peak | None = None
        self._mfu_reason: str | None = None  # why no FLOPs are counted
        log.info("precision: %s (%s); device: %s", precision.name, precision.reason, self.device)

    @property
    def precision(self) -> PrecisionPolicy:
        return self.practices.precision

    @property
    def channels_last(self) -> bool:
        return self.practices.channels_last

    # ---------------------------------------------------------------- the loop
    def fit(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None = None, *,
            resume: bool | str | Path = False, trust_checkpoint: bool = False) -> FitResult:
        """Train for `config.epochs`. `resume=True` continues from the newest good checkpoint in `checkpoint_dir`
        (or a path); `trust_checkpoint=True` lets it unpickle arbitrary objects — only for files you made."""
        cfg = self.config
        per_epoch = batches_per_epoch(train_loader, cfg.limit_batches)
        total_steps = cfg.epochs * math.ceil(per_epoch / cfg.accumulate)
        self.scheduler = warmup_cosine(self.optimizer, cfg.warmup_steps, total_steps)
        if cfg.seed is not None:
            seed_all(cfg.seed)  # a resumed run then restores the RNG states it saved
        if resume:
            self._resume(resume, trust_checkpoint)
        if cfg.checkpoint_dir and self.dist.is_main:
            clean_stale_temps(Path(cfg.checkpoint_dir))  # left by a process killed while writing
        self._preflight(train_loader)
        started = time.perf_counter()
        with ExitStack() as stack:  # each part undoes itself however fit ends
            distributed = stack.enter_context(process_group(self.dist, self.device))
            if distributed:
                check_sharding(train_loader)
            self._alone = self._ddp is None and not dist_initialized()  # read once: ~1 us a step otherwise
            fresh = self.epoch == self.step == self.batch == 0
            self.practices.plan(self._wrap(distributed), total_steps, fresh=fresh, distributed=distributed,
                                agree=lambda values: all_max(values, self.device), saved=self._saved_practices)
            stack.enter_context(torch_settings(cpu_threads=self._cpu_threads(train_loader), tf32=self.precision.tf32,
                                               cudnn_benchmark=cfg.cudnn_benchmark if self.device.type == "cuda"
                                               else None))
            if self._flops is None:
                self._mfu_reason = _uncountable(self.practices.model)
            if not self.practices.measuring and self.epoch < cfg.epochs:  # no A/B to wait for: the peak now,
                self._take_peak()  # before any step is timed
            signals = parse_signals(cfg.stop_signals)
            stop = stack.enter_context(StopSignal(signals))
            stack.enter_context(workers_ignore(signals, train_loader, val_loader))  # the main process stops them
            self._stop_schedule = StopSchedule()
            stack.enter_context(closing(train_loader, val_loader))
            monitor = stack.enter_context(Monitor()) if cfg.monitor else None
            bar = stack.enter_context(ProgressReporter(enabled=cfg.progress and self.dist.is_main,
                                                       total_steps=total_steps, interval_s=cfg.log_interval_s,
                                                       epochs=cfg.epochs))
            stack.enter_context(self._explain_oom(train_loader))  # innermost: the allocator as it failed
            emit(self.callbacks, "on_fit_start", self)
            while self.epoch < cfg.epochs:
                emit(self.callbacks, "on_epoch_start", self, self.epoch)
                self._train_epoch(train_loader, per_epoch, bar, stop)
                if stop.agreed:
                    self._stop_for_signal()
                self._end_epoch(self.practices.model, val_loader)
            self.practices.finish()
        result = self._result(time.perf_counter() - started)
        if monitor is not None:
            result = replace(result, monitor={name: s.to_json() for name, s in monitor.summary().items()})
        emit(self.callbacks, "on_fit_end", self, result)
        return result

    @contextmanager
    def _explain_oom(self, loader: Iterable[Any]) -> Iterator[None]:
        try:
            yield
        except Exception as e:
            if not is_oom(e):
                raise
            memory = memory_at_oom(self.device)
            ckpt = Path(self.config.checkpoint_dir) / "last.pt" if self.config.checkpoint_dir else None
            kept = (f"{str(ckpt)!r} is untouched: resume from it (resume=True / --resume)" if ckpt and ckpt.is_file()
                    else "no checkpoint was written yet")
            raise TrainingOutOfMemoryError(
                f"out of memory on {self.device} at epoch {self.epoch + 1}, step {self.step} (batch size "
                f"{getattr(loader, 'batch_size', None) or 'unknown'}): {first_line(e)}. {advice(e, memory)}. "
                f"{kept}") from e

    def _wrap(self, distributed: bool) -> nn.Module:
        """DDP here, compile after it (Practices): compiling the DDP module lets dynamo split graphs at buckets."""
        if not distributed:
            return self.model
        ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped: nn.Module = DistributedDataParallel(self.model, device_ids=ids)
        self._ddp = cast(DistributedDataParallel, wrapped)
        return wrapped

    def _sync_grads(self, boundary: bool) -> AbstractContextManager[object]:
        """Inside a gradient-accumulation cycle DDP need not all-reduce: only the cycle's last backward does."""
        return self._ddp.no_sync() if self._ddp is not None and not boundary else _SYNCED

    def _stop_agreed(self, stop: StopSignal) -> bool:
        """Stop now? Alone: whenever a signal came. Distributed: every rank at the same step, so the ranks agree
        every few seconds and at log points (a collective then, no per-step sync); a scheduler may signal only
        some ranks."""
        if self._alone:
            return stop.requested is not None
        schedule, at_log_point = self._stop_schedule, self.step % self.config.log_every == 0  # a sync there anyway
        return (at_log_point or schedule.due(self.step)) and schedule.agree(stop.requested is not None, self.step,
                                                                            self.device)

    def _preflight(self, loader: Iterable[Any]) -> None:
        """Environment checks for this loader before its first batch (shared memory, open files, CPUs, DB handles)
        and, on the rank that writes them, room for the checkpoints."""
        checks = preflight(loader)
        if self.config.checkpoint_dir and self.dist.is_main:
            folder, keep = Path(self.config.checkpoint_dir), self.config.keep_checkpoints
            checks.append(checkpoint_preflight(folder, estimate_checkpoint_bytes(self.model, self.optimizer), keep,
                                               kept_bytes(folder, keep)))
        for check in checks:
            if check.status in ("warn", "fail"):
                fix = f" (fix: {check.fix})" if check.fix else ""
                log.warning("pre-flight %s: %s%s", check.name, check.detail, fix)

    def _train_epoch(self, loader: Iterable[Any], n_batches: int, bar: ProgressReporter, stop: StopSignal) -> None:
        cfg, clock, acc, practices = self.config, self.clock, self.config.accumulate, self.practices
        model, autocast = practices.current()  # autocast is reusable across steps (not re-entrant, not needed)
        model.train()
        batches = iter(self._prefetch(position(loader, self.epoch, self.batch)))
        # FLOPs are counted on a step StepClock leaves out of every rate (a warm-up step: the dispatch mode slows it);
        # A/Bs still running don't change it (the same matmuls at any precision or layout; compile's A/B starts eager)
        count_flops = self._flops is None and self._mfu_reason is None and len(clock.step_s) < clock.warmup_steps
        clock.resume()
        for b in range(self.batch, n_batches):
            asked = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            clock.waited(asked, time.perf_counter())
            boundary = (b + 1) % acc == 0 or b + 1 == n_batches
            if practices.measuring:  # an A/B's step: its setting, timed
                batch = practices.begin(batch, self._loss, cycle_start=b % acc == 0)
                model, autocast = practices.current()
            with self._sync_grads(boundary):
                if count_flops:  # once: a local test is all the other steps pay
                    count_flops = False
                    loss = self._counted_step(model, batch, autocast)
                else:
                    loss = forward_backward(model, batch, self._loss, autocast, self.scaler, acc)
            if boundary:
                optimizer_step(self.optimizer, self.scaler, self._params, cfg.grad_clip)
                self._schedule_step()
                self.step += 1
            if practices.measuring:
                practices.end(loss, boundary=boundary)
                model, autocast = practices.current()
            self.batch = b + 1
            self._loss_sum.add_(loss.detach())  # stays on the device until a log point
            self._loss_count += 1
            if clock.warming_up_last():
                synchronize(self.device)  # the measured steps' clock starts with no warm-up work queued
            now = clock.step_done(batch_samples(batch))
            if boundary:
                if self.step % cfg.log_every == 0:
                    self._log_point()
                if bar.due(now):
                    self._show(bar, now)
                if self._stop_agreed(stop):
                    stop.agreed = True
                    break
        self._show(bar, time.perf_counter())

    def _counted_step(self, model: nn.Module, batch: Any, autocast: AbstractContextManager[object]) -> torch.Tensor:
        """forward_backward under a FLOP counter; the optimizer's FLOPs (elementwise) would count 0 anyway."""
        with FlopCounter() as counter:
            loss = forward_backward(model, batch, self._loss, autocast, self.scaler, self.config.accumulate)
        self._flops, self._flops_samples = counter.total, batch_samples(batch)
        return loss

    def _take_peak(self) -> float:
        """The device's peak FLOP/s at the run's matmul precision and thread count, when FLOPs are counted; the
        seconds it took. A measured peak (CPU, unlisted GPU) costs ~1 s, once per process for each setting."""
        started = time.perf_counter()
        if self._mfu_reason is None:
            dtype = self.precision.autocast_dtype or _weight_dtype(self.model)
            self._peak = _peak(self.device, dtype, torch.get_num_threads(), precision_of(self.device, dtype))
            if self.dist.is_main:
                log.info("peak %.3g TFLOP/s for MFU (%s)", self._peak.flops_per_s / 1e12, self._peak.source)
        return time.perf_counter() - started

    def _utilisation(self, samples_per_s: float) -> Utilisation | None:
        """MFU at this device's rate of `samples_per_s`: the counted batch's FLOPs over its time at that rate."""
        if self._flops is None or self._peak is None or not samples_per_s > 0:
            return None
        return utilisation(self._flops, self._flops_samples / samples_per_s, self._peak)

    def _schedule_step(self) -> None:
        assert self.scheduler is not None
        if not self.scaler.enabled:
            self.scheduler.step()
            return
        # A step the loss scaler skipped (inf gradients, normal while the scale settles) makes torch warn
        # that the schedule ran ahead of the optimizer; knowing would need a host sync every step.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler")
            self.scheduler.step()

    def _loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        if self.batch_loss is not None:
            return self.batch_loss(model, batch)
        try:
            if isinstance(batch, Mapping):  # unpacking would take its first two keys as (inputs, targets)
                raise TypeError
            inputs, targets = batch
        except (TypeError, ValueError):
            shape = (f" with keys {list(batch)}" if isinstance(batch, Mapping)
                     else f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            raise TypeError(f"a batch must be (inputs, targets); got {type(batch).__name__}{shape}. For other "
                            "batch layouts pass Trainer(..., batch_loss=lambda model, batch: loss)") from None
        return self.loss_fn(model(inputs), targets)

    # ---------------------------------------------------------------- logging and metrics
    def _log_point(self) -> None:
        """Every `log_every` steps: read the loss from the device (a sync) and hand metrics to callbacks."""
        window = self.clock.summary(last=self.config.log_every)
        metrics = {"step": self.step, "epoch": self.epoch, "loss": self._read_window(),
                   "lr": self.optimizer.param_groups[0]["lr"], "samples_per_s": window.samples_per_s,
                   "data_wait_fraction": window.data_wait_fraction}
        if self.scaler.enabled:  # reading the scale syncs: log points only
            metrics["loss_scale"] = self.last_loss_scale = self.scaler.loss_scale
            warning = self.scale_watch.observe(self.last_loss_scale)
            if warning and self.dist.is_main:
                log.warning("%s", warning)
        emit(self.callbacks, "on_log", self, metrics)

    def _show(self, bar: ProgressReporter, now: float) -> None:
        if bar.wants_loss and not dist_initialized():  # reading is collective under DDP: log points only
            self._read_window()
        bar.loss, bar.loss_scale = self.last_loss, self.last_loss_scale
        window = self.clock.summary(last=RATE_WINDOW)
        use = self._utilisation(window.samples_per_s)  # this device's share of the rate, against its own peak
        bar.show(now, step=self.step, epoch=self.epoch, samples_per_s=window.samples_per_s * self.dist.world_size,
                 wait_fraction=window.data_wait_fraction, mfu=use.mfu if use is not None else None)

    def _read_window(self) -> float | None:
        if self._loss_count == 0:  # every rank has taken the same steps: all return here together
            return None
        total, count = all_sum([float(self._loss_sum.item()), float(self._loss_count)], self.device)
        self._loss_sum.zero_()
        self._loss_count = 0
        self.last_loss = total / count
        skipped = self.scaler.skipped_steps if self.scaler.enabled else 0
        new_skips, self._skipped_seen = skipped - self._skipped_seen, skipped
        steps, self._window_from_step = self.step - self._window_from_step, self.step  # optimizer steps, not batches
        if not math.isfinite(total):
            if self.scaler.enabled and new_skips < max(steps, 1):
                # fp16 overflow that the scaler skipped: expected while the loss scale settles
                log.warning("%d of the last %d optimizer steps were skipped by the loss scaler (non-finite "
                            "gradients)", new_skips, steps)
                return None
            last = f"{self.config.checkpoint_dir}/last.pt" if self.config.checkpoint_dir else "none written"
            raise NonFiniteLossError(
                f"training loss became non-finite ({total}) within the {count} batches before step {self.step} "
                f"(epoch {self.epoch + 1}); training stopped and no checkpoint was written after it "
                f"(last checkpoint: {last}). Try a lower lr (now {self.config.lr}), keep grad_clip on, "
                "prefer precision='bf16-mixed' to '16-mixed', and check the inputs for NaN")
        self._epoch_loss[0] += total
        self._epoch_loss[1] += count
        return total / count

    def validate(self, model: nn.Module, loader: Iterable[Any]) -> dict[str, float]:
        """Mean loss (and accuracy for class-index targets) under autocast and no_grad; one sync at the end."""
        model.eval()
        loss_sum = torch.zeros((), device=self.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        seen = 0
        classify = True
        with torch.no_grad(), self.precision.autocast():
            for i, batch in enumerate(self._prefetch(loader)):
                if self.config.limit_val_batches is not None and i >= self.config.limit_val_batches:
                    break
                n = batch_samples(batch)
                if self.batch_loss is not None:
                    loss_sum += self.batch_loss(model, batch).float() * n
                    classify = False
                else:
                    inputs, targets = batch
                    out = model(inputs)
                    loss_sum += self.loss_fn(out, targets).float() * n
                    classify = classify and out.dim() == 2 and targets.dim() == 1 and not targets.is_floating_point()
                    if classify:
                        correct += (out.argmax(dim=1) == targets).sum()
                seen += n
        model.train()
        total_loss, total_correct, total_seen = all_sum(  # every rank validated its own shard
            [float(loss_sum.item()), float(correct.item()), float(seen)], self.device)
        if total_seen == 0:
            return {}
        metrics = {"val_loss": total_loss / total_seen}
        if classify:
            metrics["val_accuracy"] = total_correct / total_seen
        return metrics

    # ---------------------------------------------------------------- epochs, checkpoints, resume
    def _end_epoch(self, model: nn.Module, val_loader: Iterable[Any] | None) -> None:
        self._read_window()
        total, count = self._epoch_loss
        metrics: dict[str, float] = {"train_loss": total / count} if count else {}
        if val_loader is not None:
            metrics |= self.validate(model, val_loader)
            emit(self.callbacks, "on_validation_end", self, metrics)
        self.last_metrics = metrics
        self.epoch, self.batch = self.epoch + 1, 0
        self._epoch_loss = [0.0, 0]
        score = metrics.get("val_accuracy", -metrics["val_loss"] if "val_loss" in metrics else None)
        improved = score is not None and (self.best_metric is None or score > self.best_metric)
        if improved:
            self.best_metric = score
        if self.config.checkpoint_dir:
            path = self.save(Path(self.config.checkpoint_dir) / "last.pt")
            if improved and self.dist.is_main:
                best = copy_best(path, Path(self.config.checkpoint_dir) / "best.pt")  # a failure only warns
                if best is not None:
                    emit(self.callbacks, "on_checkpoint", self, best)
            barrier()
        emit(self.callbacks, "on_epoch_end", self, self.epoch - 1, metrics)
        self.clock.resume()

    def state_dict(self, rng_per_rank: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        assert self.scheduler is not None
        rngs = rng_per_rank or [rng_state(self.device)]
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(),
                "epoch": self.epoch, "step": self.step, "batch": self.batch, "best_metric": self.best_metric,
                "epoch_loss": list(self._epoch_loss), "rng": rngs[0], "rng_per_rank": rngs,
                "config": self.config.to_dict(), "practices": self.practices.saved(), "versions": versions(),
                "format": 1}

    def save(self, path: Path) -> Path:
        """Write a checkpoint (collective under DDP: every rank calls it, rank 0 writes, all wait for the file).

        The previous `keep_checkpoints - 1` files are kept beside it (`last.1.pt`, ...) for a corrupt one.
        A write that fails raises `CheckpointWriteError` on every rank (the previous checkpoint stays intact)."""
        rngs = gather(rng_state(self.device))  # each rank's RNG (its dropout stream) is part of an exact resume
        failed: CheckpointWriteError | None = None
        if self.dist.is_main:
            try:
                save_checkpoint(self.state_dict(rngs), path, self.config.keep_checkpoints)
            except CheckpointWriteError as e:
                failed = e
            else:
                emit(self.callbacks, "on_checkpoint", self, path)
        # Rank 0's outcome reaches every rank here, once its write is done (the wait a barrier gave): a failure
        # stops all ranks together instead of leaving the others waiting for a file that never comes.
        outcome = gather(None if failed is None else str(failed))[0]
        if failed is not None:
            raise failed
        if outcome is not None:
            raise CheckpointWriteError(outcome)
        return path

    def _stop_for_signal(self) -> None:
        self._read_window()  # refuses to save if the loss went non-finite
        if self.config.checkpoint_dir:
            path = self.save(Path(self.config.checkpoint_dir) / "last.pt")
            if self.dist.is_main:
                log.warning("stopped at epoch %d batch %d (step %d); saved %s; resume with resume=True / --resume",
                            self.epoch + 1, self.batch, self.step, path)
        elif self.dist.is_main:
            log.warning("stopped at step %d; no checkpoint_dir, nothing saved", self.step)
        raise SystemExit(EXIT_CODE)

    def _resume(self, resume: bool | str | Path, trusted: bool) -> None:
        if resume is True:
            if not self.config.checkpoint_dir:
                raise ConfigError("resume=True needs checkpoint_dir (where last.pt lives), or pass the checkpoint path")
            # Loaded on the CPU (checkpoint.py decides): load_state_dict copies into the parameters' device.
            found = load_latest_good(Path(self.config.checkpoint_dir) / "last.pt", self.config.keep_checkpoints,
                                     trusted=trusted)
            if found is None:
                log.info("resume: no checkpoint in %s yet; starting from scratch", self.config.checkpoint_dir)
                return
            path, state = found
        else:
            path = Path(resume)  # type: ignore[arg-type]
            state = load_checkpoint(path, trusted=trusted)
        assert self.scheduler is not None
        try:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit this model/optimizer: {e}") from e
        self._saved_practices = state.get("practices")  # absent from checkpoints written before it was saved
        kept = (self._saved_practices or {}).get("precision") if self.config.precision == "auto" else None
        if kept is not None and resolve_precision(kept, self.practices.caps).needs_scaler != self.scaler.enabled:
            # "auto" resumes in the precision the run started with (Practices.plan): its loss scaler with it
            self.scaler = LossScaler(self.device, not self.scaler.enabled, self.config.scaler)
        if not self.scaler.load_state_dict(state["scaler"]) and self.scaler.enabled:  # saved in bf16 or fp32
            log.info("resume: %s holds no loss scaler state (saved without fp16 loss scaling); this fp16 run "
                     "starts a fresh loss scaler at scale %g", path, self.scaler.loss_scale)
        self.epoch, self.step, self.batch = state["epoch"], state["step"], state["batch"]
        self._window_from_step = self.step
        self.best_metric = state["best_metric"]
        self._epoch_loss = list(state["epoch_loss"])
        per_rank = state.get("rng_per_rank") or [state["rng"]]
        set_rng_state(per_rank[self.dist.rank] if len(per_rank) == self.dist.world_size else state["rng"], self.device)
        log.info("resumed from %s: epoch %d, batch %d, step %d", path, self.epoch + 1, self.batch, self.step)

    # ---------------------------------------------------------------- helpers
    def _result(self, wall_s: float) -> FitResult:
        summary = self.clock.summary()
        metrics = self.last_metrics
        use = self._utilisation(summary.samples_per_s)
        reason = use.error if use is not None else self._mfu_reason or (
            "no training step was counted" if self._flops is None
            else "the run ended before its A/Bs settled the precision" if self._peak is None
            else "no training step was timed")
        ckpt = Path(self.config.checkpoint_dir) if self.config.checkpoint_dir else None
        return FitResult(  # samples/s of the whole job: every rank trains as many samples per step
            epochs=self.epoch, steps=self.step, samples_per_s=summary.samples_per_s * self.dist.world_size,
            data_wait_fraction=summary.data_wait_fraction, final_loss=metrics.get("train_loss"),
            val_loss=metrics.get("val_loss"), val_accuracy=metrics.get("val_accuracy"),
            checkpoint=str(ckpt / "last.pt") if ckpt and (ckpt / "last.pt").exists() else None,
            best_checkpoint=str(ckpt / "best.pt") if ckpt and (ckpt / "best.pt").exists() else None,
            skipped_steps=self.scaler.skipped_steps if self.scaler.enabled else 0, wall_s=wall_s,
            loss_scale=self.scaler.loss_scale if self.scaler.enabled else None, **self.practices.to_json(),
            mfu=use.mfu if use is not None else None, mfu_reason=reason, flops_per_step=self._flops,
            peak_flops_per_s=self._peak.flops_per_s if self._peak else None,
            peak_source=self._peak.source if self._peak else None)

    def _prefetch(self, loader: Iterable[Any]) -> Iterable[Any]:
        return prefetch(loader, self.device, lambda: self.practices.channels_last)

    def _cpu_threads(self, loader: Iterable[Any]) -> int | None:
        threads = self.config.cpu_threads
        if threads != "auto":
            return threads  # type: ignore[return-value]
        if self.device.type != "cpu":
            return None
        plan = getattr(loader, "plan", None)
        if plan is not None and plan.cpu_threads is not None:
            shared = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1  # make_loader scaled the tuning to this rank
            log.info("cpu_threads=%d beside %d worker(s): trainfast tune's measured best%s", plan.cpu_threads,
                     plan.num_workers, ", scaled to this process's share of the CPUs" if shared else "")
            return int(plan.cpu_threads)
        workers = plan.num_workers if plan is not None else getattr(loader, "num_workers", 0)
        cpus = max(1, available_cpus() // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # ranks share the machine
        chosen = threads_beside_workers(cpus, workers)
        log.info("cpu_threads=%d: %d usable CPUs shared with %d loader worker(s)", chosen, cpus, workers)
        return chosen


@functools.lru_cache(maxsize=16)
def _peak(device: torch.device, dtype: torch.dtype, threads: int, precision: str) -> Peak:
    """peak_flops, once per process for each setting (`precision` tells TF32 on from off): a measured peak costs
    ~1 s, which a process that fits many times (a sweep, the tests) would pay at each."""
    return peak_flops(device, dtype, threads=threads)


def _weight_dtype(model: nn.Module) -> torch.dtype:
    """The dtype an un-autocast model's matmuls run in: its first floating parameter's (float32 if unusual)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return dtype if dtype in (torch.bfloat16, torch.float16, torch.float64) else torch.float32


def _uncountable(model: nn.Module) -> str | None:
    """Why this model's FLOPs can't be counted: a compiled module would recompile under the counter's dispatch mode
    (and its graph holds no aten calls to count). None when they can."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not loaded: nothing was compiled
    if eval_frame is not None and any(isinstance(m, eval_frame.OptimizedModule) for m in model.modules()):
        reason = ("FLOPs not counted: the model is compiled, and counting them (a dispatch mode) would make "
                  "torch.compile recompile")
        log.info("MFU: %s", reason)
        return reason
    return None
