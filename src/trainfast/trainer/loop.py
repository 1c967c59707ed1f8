"""The Trainer: a plain training loop with every speed practice on, readable top to bottom.

fetch (timed) -> device (prefetched) -> autocast forward -> scaled backward -> unscale -> clip ->
step -> zero_grad(set_to_none) -> schedule -> log every `log_every` steps. Nothing in a step waits
for the device: the loss is summed on the device and read only at log points.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainfast.device import resolve_device, synchronize
from trainfast.dynamo import dynamo_counts
from trainfast.launch import launch_env
from trainfast.loader.seeding import seed_all
from trainfast.monitor import Monitor
from trainfast.precision.policy import PrecisionPolicy, ScaleWatch
from trainfast.samples import batch_samples
from trainfast.tensorboard import ScalarWriter, TensorBoardUnavailableError, require_tensorboard
from trainfast.trainer.callbacks import check_callbacks, emit
from trainfast.trainer.checkpoint import clean_stale_temps, room_for_checkpoints
from trainfast.trainer.clock import StepClock
from trainfast.trainer.config import ConfigError, TrainConfig
from trainfast.trainer.distributed import all_max, any_rank, dist_info, dist_initialized, process_group, side_group
from trainfast.trainer.feeding import (
    batches_per_epoch,
    check_sharding,
    closing,
    cpu_threads_beside,
    end_epoch,
    position,
    prefetch,
    warn_before_training,
    whole_epoch,
)
from trainfast.trainer.loss_window import LossWindow, NonFiniteLossError
from trainfast.trainer.mfu import MfuMeter, weight_dtype
from trainfast.trainer.out_of_memory import TrainingOutOfMemoryError, explained_oom
from trainfast.trainer.phases import RunPhases, compile_excess
from trainfast.trainer.practices import Practices
from trainfast.trainer.progress import RATE_WINDOW, ProgressReporter
from trainfast.trainer.ranks import Ranks
from trainfast.trainer.result import FitResult
from trainfast.trainer.schedule import step_schedule, warmup_cosine
from trainfast.trainer.settings import torch_settings
from trainfast.trainer.sharded_checkpoint import clean_stale_folders
from trainfast.trainer.sharding import choose_strategy
from trainfast.trainer.signals import EXIT_CODE, StopSignal, parse_signals, workers_ignore
from trainfast.trainer.state import WRITE_FAILED, TrainerState
from trainfast.trainer.step import (
    LossOf,
    default_batch_loss,
    forward_backward,
    optimizer_step,
    pair_loss,
    prepare_step,
    renamed_step_fn,
    unpack_pair,
)
from trainfast.trainer.validation import validate

__all__ = ["NonFiniteLossError", "Trainer", "TrainingOutOfMemoryError"]
log = logging.getLogger("trainfast")
_NOTHING = nullcontext()  # reusable: no object built per step


class Trainer:
    """Train `model` with AdamW + warm-up cosine (unless given an optimizer) and `default_batch_loss` (unless given a
    loss: `loss_fn(outputs, targets)` for `(inputs, targets)` batches, or `batch_loss(model, batch)` for any)."""

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
            if cfg.tensorboard and self.dist.is_main:
                require_tensorboard()  # before any training, not at the first log point
        except (ValueError, TensorBoardUnavailableError) as e:
            raise ConfigError(str(e)) from None
        prepared = prepare_step(model, self.device, lr=cfg.lr, weight_decay=cfg.weight_decay, precision=cfg.precision,
                                channels_last=cfg.channels_last, optimizer=optimizer, scaler=cfg.scaler)
        self.model, self.optimizer, self.scaler = prepared.model, prepared.optimizer, prepared.scaler
        self._params = prepared.params
        # precision, channels_last and compile: priors now, confirmed by A/Bs on the first steps of fit
        self.practices = Practices(self.model, self.optimizer, self.device, prepared.caps, prepared.precision,
                                   prepared.channels_last, cfg)
        # MFU's peak is the settled precision's; taken in the loop, its time is left out of the step it falls in
        self.practices.on_settled = self._peak_in_loop
        self.loss_fn = loss_fn or pair_loss
        self.batch_loss = renamed_step_fn(batch_loss, step_fn)
        self._loss_of: LossOf = self.batch_loss or (default_batch_loss if loss_fn is None else self._with_loss_fn)
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.clock = StepClock()
        self.epoch = self.step = self.batch = 0  # position: next epoch / optimizer steps done / next batch
        self.best_metric: float | None = None
        self.losses = LossWindow(self.device)
        self.last_metrics: dict[str, float] = {}  # train_loss, val_loss, val_accuracy of the last epoch
        self.scale_watch = ScaleWatch(bf16_here=prepared.caps.bf16)
        self.last_loss_scale: float | None = None
        self.state = TrainerState(self)
        self.mfu = MfuMeter()
        self.ranks = Ranks()
        self.tensorboard: ScalarWriter | None = None  # open during fit with TrainConfig(tensorboard=...), rank 0
        self.phases = RunPhases()  # fit's own whole-run account, made afresh by each fit
        self._compiling: list[int] = []  # steps (StepClock indexes) during which torch.compile compiled frames
        self._steps_before = 0  # steps in the clock when this fit began (a second fit of the Trainer appends)
        log.info("precision: %s (%s); device: %s", self.precision.name, self.precision.reason, self.device)

    @property
    def precision(self) -> PrecisionPolicy:
        return self.practices.precision

    @property
    def channels_last(self) -> bool:
        return self.practices.channels_last

    @property
    def last_loss(self) -> float | None:
        """The mean training loss at the last read (a log point or an epoch's end)."""
        return self.losses.last

    # ---------------------------------------------------------------- the loop
    def fit(self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None = None, *,
            resume: bool | str | Path = False, trust_checkpoint: bool = False) -> FitResult:
        """Train for `config.epochs`. `resume=True` continues from the newest good checkpoint in `checkpoint_dir`
        (or a path); `trust_checkpoint=True` lets it unpickle arbitrary objects — only for files you made.

        The result's `whole_run` accounts for fit's wall time in phases (`trainer/phases.py`)."""
        self.phases, self._compiling = RunPhases(), []  # fit's wall time starts here
        self._steps_before = len(self.clock.step_s)
        cfg = self.config
        per_epoch = batches_per_epoch(train_loader, cfg.limit_batches)
        total_steps = cfg.epochs * math.ceil(per_epoch / cfg.accumulate)
        self.scheduler = warmup_cosine(self.optimizer, cfg.warmup_steps, total_steps)
        if cfg.seed is not None:
            seed_all(cfg.seed)  # a resumed run then restores the RNG states it saved
        self.state.blocked_s, self.state.write_s = [], []  # this fit's saves
        with ExitStack() as stack:  # each part undoes itself however fit ends
            bar, stop, monitor = self._set_up(stack, train_loader, val_loader, total_steps,
                                              lambda: self.state.restore(resume, trust_checkpoint) if resume else None)
            emit(self.callbacks, "on_fit_start", self)
            while self.epoch < cfg.epochs:
                emit(self.callbacks, "on_epoch_start", self, self.epoch)
                self._train_epoch(train_loader, per_epoch, bar, stop)
                if stop.agreed:
                    self._stop_for_signal()
                self._end_epoch(self.practices.model, val_loader)
            self.practices.finish()
        result = self._result()
        if monitor is not None:
            result = replace(result, monitor={name: s.to_json() for name, s in monitor.summary().items()})
        emit(self.callbacks, "on_fit_end", self, result)
        return result

    def _set_up(self, stack: ExitStack, train_loader: Iterable[Any], val_loader: Iterable[Any] | None,
                total_steps: int, restore: Callable[[], None]) -> tuple[ProgressReporter, StopSignal, Monitor | None]:
        """Everything `fit` arranges before its first step, each part entered on `stack` so that it is undone however
        fit ends: checks of the loaders and the checkpoint folder, the process group, DDP or FSDP, the checkpoint to
        resume from (`restore`: into the sharded model under FSDP), the A/B plan, threads, the MFU peak, signals,
        the loaders' shutdown, the monitor and the progress display."""
        cfg = self.config
        if cfg.checkpoint_dir and self.dist.is_main:
            clean_stale_temps(Path(cfg.checkpoint_dir))  # left by a process killed while writing
            clean_stale_folders(Path(cfg.checkpoint_dir))
        warn_before_training(train_loader, room_for_checkpoints(Path(cfg.checkpoint_dir), self.model, self.optimizer,
                                                                cfg.keep_checkpoints)
                             if cfg.checkpoint_dir and self.dist.is_main else None)
        distributed = stack.enter_context(process_group(self.dist, self.device))
        stack.enter_context(self.state.writes_joined())  # inside the process group: its outcome is shared over it
        if distributed:
            check_sharding(train_loader)
        model = self._distribute(distributed)
        restore()
        fresh = self.epoch == self.step == self.batch == 0
        self.practices.plan(model, total_steps, fresh=fresh, distributed=distributed, sharded=self.ranks.sharded,
                            agree=lambda values: all_max(values, self.device), saved=self.state.saved_practices)
        threads = cpu_threads_beside(train_loader, cfg.cpu_threads, self.device)
        stack.enter_context(torch_settings(cpu_threads=threads, tf32=self.precision.tf32,
                                           cudnn_benchmark=cfg.cudnn_benchmark if self.device.type == "cuda"
                                           else None))
        self.mfu.check(self.practices.model)
        if not self.practices.measuring and self.epoch < cfg.epochs:  # no A/B to wait for: the peak now,
            self._take_peak()  # before any step is timed
        signals = parse_signals(cfg.stop_signals)
        stop = stack.enter_context(StopSignal(signals))
        stack.enter_context(workers_ignore(signals, train_loader, val_loader))  # the main process stops them
        stack.enter_context(closing(train_loader, val_loader))
        monitor = stack.enter_context(Monitor()) if cfg.monitor else None
        if cfg.tensorboard and self.dist.is_main:
            self.tensorboard = stack.enter_context(ScalarWriter(cfg.tensorboard))
            stack.callback(setattr, self, "tensorboard", None)
        bar = stack.enter_context(ProgressReporter(enabled=cfg.progress and self.dist.is_main,
                                                   total_steps=total_steps, interval_s=cfg.log_interval_s,
                                                   epochs=cfg.epochs))
        batch_size = getattr(train_loader, "batch_size", None) or "unknown"
        stack.enter_context(explained_oom(  # innermost: the allocator as it failed
            self.device, lambda: f"epoch {self.epoch + 1}, step {self.step} (batch size {batch_size})",
            cfg.checkpoint_dir, settle=self.state.wait_here))
        return bar, stop, monitor

    def _distribute(self, distributed: bool) -> nn.Module:
        """The model to train: DDP-wrapped or sharded in place (FSDP, checkpoints then sharded too) when distributed,
        as `config.strategy` asks or "auto" chooses (`choose_strategy`, on figures every rank agrees on)."""
        if not distributed:
            if self.config.strategy == "fsdp" and self.dist.is_main:
                log.info("strategy='fsdp' has no effect in a single process; start several with torchrun")
            return self.ranks.start(self.model, self.device, None)
        choice = choose_strategy(self.config.strategy, self.model, self.optimizer, self.device,
                                 ranks_here=launch_env().local_world_size,
                                 agree=lambda flag: any_rank(flag, self.device))
        try:
            model = self.ranks.start(self.model, self.device, choice.name, self.optimizer, self.precision)
        except ValueError as e:
            raise ConfigError(f"{e} ({choice.reason})") from None
        if self.ranks.sharded:
            self._params = [p for p in self.model.parameters() if p.requires_grad]
            self.practices.channels_last = False  # sharded contiguous: batches stay as they come
            self.state.shard_checkpoints(side_group())
        if self.dist.is_main:
            log.info("strategy: %s (%s)%s", choice.name, choice.reason, self.ranks.described)
        return model

    def _train_epoch(self, loader: Iterable[Any], n_batches: int, bar: ProgressReporter, stop: StopSignal) -> None:
        cfg, clock, practices, loss_of = self.config, self.clock, self.practices, self._loss_of
        acc = cfg.accumulate
        model, autocast = practices.current()  # autocast is reusable across steps (not re-entrant, not needed)
        model.train()
        since = self.phases.epoch_begins()  # the first epoch's iter() ends fit's start-up
        batches = iter(self._prefetch(position(loader, self.epoch, self.batch)))
        # FLOPs are counted on a step StepClock leaves out of every rate (a warm-up step: the dispatch mode slows it);
        # A/Bs still running don't change it (the same matmuls at any precision or layout; compile's A/B starts eager)
        count_flops = self.mfu.wants_count and len(clock.step_s) < clock.warmup_steps
        alone = self.ranks.alone
        train_from: float | None = None  # the epoch's first batch: its start ends, its steps begin
        ended = False  # the loop took all of the loader's batches: the loader is then told the epoch is over
        clock.resume()
        for b in range(self.batch, n_batches):
            asked = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                break
            got = time.perf_counter()
            clock.waited(asked, got)
            if train_from is None:
                train_from = self.phases.add("epoch_start", since, got)
            # the first steps and the A/Bs' (where torch.compile may compile): frames compiled during the step
            frames = dynamo_counts()["frames"] if practices.measuring or len(clock.step_s) < clock.warmup_steps \
                else None
            boundary = (b + 1) % acc == 0 or b + 1 == n_batches
            if practices.measuring:  # an A/B's step: its setting, timed
                batch = practices.begin(batch, loss_of, cycle_start=b % acc == 0)
                model, autocast = practices.current()
            counting = self.mfu.counting(batch_samples(batch)) if count_flops else _NOTHING
            count_flops = False  # once: a local test is all the other steps pay
            with self.ranks.sync_grads(boundary), counting:
                loss = forward_backward(model, batch, loss_of, autocast, self.scaler, acc)
            if boundary:
                optimizer_step(self.optimizer, self.scaler, self._params, cfg.grad_clip)
                step_schedule(self.scheduler, self.scaler.enabled)
                self.step += 1
            if practices.measuring:
                practices.end(loss, boundary=boundary)
                model, autocast = practices.current()
            self.batch = b + 1
            self.losses.add(loss)  # stays on the device until a log point
            if clock.warming_up_last():
                synchronize(self.device)  # the measured steps' clock starts with no warm-up work queued
            now = clock.step_done(batch_samples(batch))
            if frames is not None and dynamo_counts()["frames"] > frames:
                self._compiling.append(len(clock.step_s) - 1)
            if boundary:
                if self.step % cfg.log_every == 0:
                    self._log_point()
                if bar.due(now):
                    self._show(bar, now)
                if (stop.requested is not None if alone  # alone: no collective, any signal stops at once
                        else self.ranks.stop_agreed(stop, self.step, self.step % cfg.log_every == 0, self.device,
                                                    self.state.write_status())):
                    stop.agreed = True
                    break
                if (settled := self.ranks.writes_settled()) is not None:  # FSDP: every rank's part written
                    self._put_in_place(failed=settled == WRITE_FAILED)
        else:
            ended = whole_epoch(loader, n_batches)
        if train_from is None:  # no batch this epoch
            train_from = self.phases.add("epoch_start", since)
        self._show(bar, time.perf_counter())
        synchronize(self.device)  # once an epoch: the steps' queued device work is training's time
        self.phases.add("train", train_from)
        if ended:  # the loader's own end of the epoch: its next epoch's first batches are being made already
            end_epoch(batches)

    def _put_in_place(self, failed: bool) -> None:
        """Inside a step: the sharded checkpoint every rank has written goes in place (`TrainerState.put_in_place`),
        or a rank's failed write stops training on every rank. Its time is the save's (`checkpoint_blocked_s`, the
        checkpoint phase), not the step's."""
        since = time.perf_counter()
        self.state.put_in_place(failed)
        seconds = time.perf_counter() - since
        self.state.blocked_s[-1] += seconds
        self.clock.leave_out(seconds)
        self.phases.aside(seconds)
        self.phases.seconds["checkpoint"] += seconds

    def _peak_in_loop(self) -> None:
        """The A/Bs have settled, inside a step: MFU's peak is measured now, its time left out of the step and of
        training (it is `other`)."""
        seconds = self._take_peak()
        self.clock.leave_out(seconds)
        self.phases.aside(seconds)

    def _take_peak(self) -> float:
        dtype = self.precision.autocast_dtype or weight_dtype(self.model)
        return self.mfu.take_peak(self.device, dtype, say=self.dist.is_main)

    def _with_loss_fn(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, targets = unpack_pair(batch)
        return self.loss_fn(model(inputs), targets)

    # ---------------------------------------------------------------- logging and metrics
    def _log_point(self) -> None:
        """Every `log_every` steps: read the loss from the device (a sync) and hand metrics to callbacks."""
        window = self.clock.summary(last=self.config.log_every)
        loss = self._read_window()  # its sync waits for the steps' own device work: training's time
        since = time.perf_counter()  # the rest is host work for the log point: `other`
        metrics = {"step": self.step, "epoch": self.epoch, "loss": loss,
                   "lr": self.optimizer.param_groups[0]["lr"], "samples_per_s": window.samples_per_s,
                   "data_wait_fraction": window.data_wait_fraction}
        if self.scaler.enabled:  # reading the scale syncs: log points only
            metrics["loss_scale"] = self.last_loss_scale = self.scaler.loss_scale
            warning = self.scale_watch.observe(self.last_loss_scale)
            if warning and self.dist.is_main:
                log.warning("%s", warning)
        if self.tensorboard is not None:  # host values only: no sync beyond the loss read above
            use = self.mfu.at(window.samples_per_s)
            self.tensorboard.scalars(self.step, {
                "train/loss": metrics["loss"], "train/lr": metrics["lr"],
                "train/samples_per_s": window.samples_per_s * self.dist.world_size,  # the job's, as the progress line
                "train/data_wait_fraction": window.data_wait_fraction,
                "train/mfu": use.mfu if use is not None else None, "train/loss_scale": metrics.get("loss_scale")})
        emit(self.callbacks, "on_log", self, metrics)
        self.phases.aside(time.perf_counter() - since)

    def _show(self, bar: ProgressReporter, now: float) -> None:
        if bar.wants_loss and not dist_initialized():  # reading is collective under DDP: log points only
            self._read_window()
        since = time.perf_counter()  # after the read (training's time): the progress line is `other`
        bar.loss, bar.loss_scale = self.last_loss, self.last_loss_scale
        window = self.clock.summary(last=RATE_WINDOW)
        use = self.mfu.at(window.samples_per_s)  # this device's share of the rate, against its own peak
        bar.show(now, step=self.step, epoch=self.epoch, samples_per_s=window.samples_per_s * self.dist.world_size,
                 wait_fraction=window.data_wait_fraction, mfu=use.mfu if use is not None else None)
        self.phases.aside(time.perf_counter() - since)

    def _read_window(self) -> float | None:
        last = f"{self.config.checkpoint_dir}/last.pt" if self.config.checkpoint_dir else "none written"
        return self.losses.read(self.step, self.scaler, (
            f"(epoch {self.epoch + 1}); training stopped and no checkpoint was written after it (last checkpoint: "
            f"{last}). Try a lower lr (now {self.config.lr}), keep grad_clip on, prefer precision='bf16-mixed' to "
            "'16-mixed', and check the inputs for NaN"))

    def validate(self, model: nn.Module, loader: Iterable[Any]) -> dict[str, float]:
        """Mean loss (and accuracy for class-index targets) under autocast and no_grad; one sync at the end."""
        return validate(model, self._prefetch(loader), device=self.device, precision=self.precision,
                        loss_of=self._loss_of, loss_fn=self.loss_fn if self.batch_loss is None else None,
                        limit=self.config.limit_val_batches)

    # ---------------------------------------------------------------- epochs, checkpoints
    def _end_epoch(self, model: nn.Module, val_loader: Iterable[Any] | None) -> None:
        self._read_window()
        train_loss = self.losses.epoch_mean()
        metrics: dict[str, float] = {"train_loss": train_loss} if train_loss is not None else {}
        if val_loader is not None:
            since = time.perf_counter()
            metrics |= self.validate(model, val_loader)
            self.phases.add("evaluation", since)
            emit(self.callbacks, "on_validation_end", self, metrics)
        self.last_metrics = metrics
        self.epoch, self.batch = self.epoch + 1, 0
        self.losses.epoch = [0.0, 0]
        score = metrics.get("val_accuracy", -metrics["val_loss"] if "val_loss" in metrics else None)
        improved = score is not None and (self.best_metric is None or score > self.best_metric)
        if improved:
            self.best_metric = score
        if self.tensorboard is not None:
            val = {"val/" + name.removeprefix("val_"): value for name, value in metrics.items()
                   if name.startswith("val_")}
            self.tensorboard.scalars(self.step, {"train/epoch_loss": metrics.get("train_loss")} | val)
            self.tensorboard.flush()
        if self.config.checkpoint_dir:
            # Training waits for the capture and the copy to host memory; rank 0 writes last.pt (then best.pt) on a
            # thread while the next epoch trains. The write is joined at the next save or at the end of fit.
            folder = Path(self.config.checkpoint_dir)
            self.state.save_in_background(folder / "last.pt", folder / "best.pt" if improved else None)
            self.phases.seconds["checkpoint"] += self.state.blocked_s[-1]  # training blocked by the save
            if self.epoch >= self.config.epochs:  # the last epoch: nothing left to train beside the write
                self.state.join()  # (`other`: the wait at the end for the last write)
        emit(self.callbacks, "on_epoch_end", self, self.epoch - 1, metrics)
        self.clock.resume()

    def state_dict(self, rng_per_rank: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """What a checkpoint holds (`TrainerState.capture`)."""
        return self.state.capture(rng_per_rank)

    def save(self, path: Path) -> Path:
        """Write a checkpoint (collective under DDP: every rank calls it, rank 0 writes, all wait for the file).

        Synchronous: a background write of `fit`'s still in flight is waited for first, then this one is written
        before it returns. The previous `keep_checkpoints - 1` files are kept beside it (`last.1.pt`, ...) for a
        corrupt one. A write that fails raises `CheckpointWriteError` on every rank (the previous checkpoint stays
        intact)."""
        return self.state.save(path)

    def _stop_for_signal(self) -> None:
        self._read_window()  # refuses to save if the loss went non-finite
        if self.config.checkpoint_dir:  # synchronous (the process exits next), after the write in flight
            path = self.save(Path(self.config.checkpoint_dir) / "last.pt")
            if self.dist.is_main:
                log.warning("stopped at epoch %d batch %d (step %d); saved %s; resume with resume=True / --resume",
                            self.epoch + 1, self.batch, self.step, path)
        elif self.dist.is_main:
            log.warning("stopped at step %d; no checkpoint_dir, nothing saved", self.step)
        if not self.dist.is_main:  # on several machines rank 0's line is in another machine's log, not beside this exit
            log.warning("rank %d: stopped at step %d with every rank (a rank of the job received a stop signal)%s",
                        self.dist.rank, self.step, "; rank 0 saved last.pt" if self.config.checkpoint_dir else "")
        raise SystemExit(EXIT_CODE)

    def _result(self) -> FitResult:
        first = self._steps_before  # this fit's steps in the clock (a second fit of the same Trainer appends)
        compile_s = compile_excess(self.clock.step_s[first:], self.clock.wait_s[first:],
                                   [i - first for i in self._compiling], warmup=self.clock.warmup_steps)
        whole_run = self.phases.report(compile_s=compile_s)
        wall_s = whole_run["wall_s"]
        summary = self.clock.summary()
        metrics = self.last_metrics
        use = self.mfu.at(summary.samples_per_s)
        ckpt = Path(self.config.checkpoint_dir) if self.config.checkpoint_dir else None
        last, best = ("last.dcp", "best.dcp") if self.ranks.sharded else ("last.pt", "best.pt")
        peak = self.mfu.peak
        blocks = self.practices.to_json()  # FitResult has a typed field for each of the first three practices
        return FitResult(  # samples/s of the whole job: every rank trains as many samples per step
            epochs=self.epoch, steps=self.step, samples_per_s=summary.samples_per_s * self.dist.world_size,
            data_wait_fraction=summary.data_wait_fraction, final_loss=metrics.get("train_loss"),
            val_loss=metrics.get("val_loss"), val_accuracy=metrics.get("val_accuracy"),
            checkpoint=str(ckpt / last) if ckpt and (ckpt / last).exists() else None,
            best_checkpoint=str(ckpt / best) if ckpt and (ckpt / best).exists() else None,
            skipped_steps=self.scaler.skipped_steps if self.scaler.enabled else 0, wall_s=wall_s,
            loss_scale=self.scaler.loss_scale if self.scaler.enabled else None, precision=blocks.pop("precision", None),
            channels_last=blocks.pop("channels_last", None), compile=blocks.pop("compile", None),
            other_practices=blocks, ab_steps=self.practices.ab_steps(),
            mfu=use.mfu if use is not None else None, mfu_reason=self.mfu.why_none(use), flops_per_step=self.mfu.flops,
            peak_flops_per_s=peak.flops_per_s if peak else None, peak_source=peak.source if peak else None,
            checkpoint_blocked_s=list(self.state.blocked_s), checkpoint_write_s=list(self.state.write_s),
            whole_run=whole_run)

    def _prefetch(self, loader: Iterable[Any]) -> Iterable[Any]:
        return prefetch(loader, self.device, lambda: self.practices.channels_last)
