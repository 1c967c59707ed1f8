"""The tensors' hook: what the script does with its tensors that the rules read.

- `Tensor.item` / `tolist` / `__float__` / `__int__` of a tensor on a device: counted and timed, host syncs.
- `Tensor.to` / `Tensor.cuda` (only where CUDA exists): host time blocked in host-to-device copies and, in the
  measured steps, CUDA events around each copy (devicetime.py): the copy's own time, read at report time.
- `autocast.__enter__` and JPEG `load()` in this process: whether the script trains in mixed precision, and at what
  size it decodes its images.
Each is one `perf_counter` pair or a counter per call.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
from PIL import ImageFile

from trainfast.diagnose.capture.sites import site_of

if TYPE_CHECKING:
    from trainfast.diagnose.capture.model_hook import ModelHook
    from trainfast.diagnose.capture.observations import Patch, Watching


class TensorHook:
    def __init__(self, inst: Watching, model: ModelHook, *, time_transfers: bool) -> None:
        self.inst, self.model, self.time_transfers = inst, model, time_transfers

    def install(self, patch: Patch) -> None:
        for name in ("item", "tolist", "__float__", "__int__"):
            patch(torch.Tensor, name, self._counting_sync(getattr(torch.Tensor, name)))
        if self.time_transfers:
            for name, destination in (("to", _to_destination), ("cuda", _cuda_destination)):
                patch(torch.Tensor, name, self._timed_copy(getattr(torch.Tensor, name), destination))
        self._precision_and_images(patch)

    def uninstall(self) -> None:
        pass  # (its patches are the instrumentation's to undo; it keeps nothing of the script's)

    def _counting_sync(self, original: Callable[..., Any]) -> Callable[..., Any]:
        inst = self.inst
        timeline, observed = inst.timeline, inst.observed

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            # A CPU tensor's value is at hand (no device to wait for), a dataset's reads inside a loader's next()
            # are data wait, and torch's own calls (AdamW reading its step count) are not the script's to fix.
            if (tensor.device.type == "cpu" or inst.fetching or inst.paused
                    or sys._getframe(1).f_globals.get("__name__", "").startswith("torch")):
                return original(tensor, *args, **kwargs)
            if inst.scanning:
                inst.discover("sync")
            started = time.perf_counter()
            out = original(tensor, *args, **kwargs)
            observed.syncs += 1
            timeline.synced(time.perf_counter() - started)
            return out
        return counted

    def _timed_copy(self, original: Callable[..., Any],
                    destination: Callable[[tuple[Any, ...], dict[str, Any]], torch.device | None]
                    ) -> Callable[..., Any]:
        """Host time blocked in each host-to-device copy and, in the measured steps, CUDA events around it on the
        destination's current stream (its own device time: the host time includes waiting for queued kernels)."""
        inst, model = self.inst, self.model
        timeline, timer = inst.timeline, inst.device_timer

        def timed(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if inst.fetching or inst.paused or tensor.device.type != "cpu":  # in a loader's next(): data wait already
                return original(tensor, *args, **kwargs)
            events = None
            if timeline.in_measured_step:
                device = destination(args, kwargs)
                if device is not None and device.type == "cuda":
                    events = timer.copy_started(device)
            started = perf_counter()
            out = original(tensor, *args, **kwargs)
            if isinstance(out, torch.Tensor) and out.device.type == "cuda":
                timeline.transferred(perf_counter() - started, None if events is None else timer.copy_ended(events))
                if not timer.settled:
                    model.saw_tensor(out.device)
            return out
        return timed

    def _precision_and_images(self, patch: Patch) -> None:
        inst, observed = self.inst, self.inst.observed
        autocast_cls = torch.amp.autocast_mode.autocast
        enter = autocast_cls.__enter__

        def autocast_enter(ctx: Any) -> Any:
            if getattr(ctx, "_enabled", False) and not inst.paused:  # (not the doctor's own trials: probe.py)
                observed.autocast.add((str(ctx.device), str(ctx.fast_dtype).replace("torch.", "")))
                if "autocast" not in observed.sites and (site := site_of("autocast", sys._getframe(1))) is not None:
                    observed.sites["autocast"] = site
            return enter(ctx)  # type: ignore[no-untyped-call]
        patch(autocast_cls, "__enter__", autocast_enter)

        load = ImageFile.ImageFile.load

        def jpeg_load(image: Any) -> Any:
            out = load(image)
            if getattr(image, "format", None) == "JPEG" and len(observed.jpeg_decoded_pixels) < 10_000:
                observed.jpeg_decoded_pixels.append(image.size[0] * image.size[1])
            return out
        patch(ImageFile.ImageFile, "load", jpeg_load)


def _to_destination(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device of `Tensor.to(*args, **kwargs)` (None: it keeps the tensor's), parsed as torch parses it."""
    try:
        device: torch.device | None = torch._C._nn._parse_to(*args, **kwargs)[0]
    except (TypeError, RuntimeError):  # a bad call: the real `to` raises it
        return None
    return device


def _cuda_destination(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    """The device of `Tensor.cuda(device=None, ...)`: the current CUDA device unless one is named."""
    device = args[0] if args else kwargs.get("device")
    if device is None:
        return torch.device("cuda")
    try:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (TypeError, RuntimeError):
        return None
