"""One tuning trial: a loader configuration measured at steady state, co-running the training step if given."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from trainfast.device import DeviceClock
from trainfast.loader.make import make_loader
from trainfast.loader.tuned import WorkerSettings as WorkerSettings  # re-exported: what a trial measures
from trainfast.samples import batch_samples
from trainfast.trainer.settings import torch_settings
from trainfast.trainer.step import TrainStep


@dataclass(frozen=True)
class Trial:
    config: WorkerSettings
    samples_per_s: float
    seconds: float  # wall time the trial took, start-up included

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config.to_json(), "samples_per_s": self.samples_per_s, "seconds": self.seconds}


def run_trial(dataset: Any, batch_size: int, config: WorkerSettings, *, step_fn: TrainStep | None, batches: int,
              warmup: int, device: str = "auto") -> Trial:
    """Samples/s over `batches` batches after `warmup` (worker start-up, first-batch effects excluded).

    The device is synchronised before the clock starts and before it stops (`device` names it, "auto" as
    `resolve_device` resolves it): otherwise queued warm-up work is booked to the measured batches.
    """
    started = time.perf_counter()
    loader = make_loader(dataset, batch_size, shuffle=True, workers=config.num_workers,
                         prefetch_factor=config.prefetch_factor or "auto", pin_memory=config.pin_memory,
                         persistent_workers=True, device=device, seed=0)
    samples, clock = 0, DeviceClock(device)
    try:
        with torch_settings(cpu_threads=config.cpu_threads):
            seen = 0
            if warmup == 0:
                clock.start()
            while seen < warmup + batches:
                fetched = 0
                for batch in loader:  # a short dataset is cycled: a measurement needs enough batches
                    fetched += 1
                    if step_fn is not None:
                        step_fn(batch)
                    seen += 1
                    if seen == warmup:
                        clock.start()
                    elif seen > warmup:
                        samples += batch_samples(batch)
                    if seen >= warmup + batches:
                        break
                if fetched == 0:
                    raise ValueError("the dataset yields no batch at this batch size; lower batch_size")
            elapsed = clock.elapsed()
    finally:
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return Trial(config, samples / elapsed if elapsed > 0 else 0.0, time.perf_counter() - started)
