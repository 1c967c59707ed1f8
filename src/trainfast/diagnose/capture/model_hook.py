"""The model's hook: the models a script trains, found without its help, and what their forwards say.

The models are the root modules (a module with parameters that no other module contains), found by walking the
garbage collector's objects (~0.1 s, at the first batch, backward, optimizer step, sync or `no_grad()` block, and
again when the first step closes); each root's class gets its `__call__` wrapped, not torch's global module hooks:
those cost ~2.4 us per submodule call here and make `torch.compile` warn and recompile when they are removed. A
root's forward starts an iteration when no loader feeds it, and its input's leading dimension counts samples; with
gradients off it is an evaluation or a collection phase (timeline.py). The model's device is taken from its
parameters at its first training forward and at the first optimizer step (the last word), or meanwhile from a batch
or copy on a CUDA device: CUDA events go there, and nowhere before. At each optimizer's first step, the parameters it
trains and their models' convolutions are described (their layout: channels_last or NCHW)."""

from __future__ import annotations

import functools
import gc
import math
import sys
import warnings
import weakref
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from trainfast.diagnose.capture.sites import SiteMap, site_of
from trainfast.samples import batch_samples, first_leaf

if TYPE_CHECKING:
    from trainfast.diagnose.capture.observations import Patch, Watching

# First scans for the model that may find none before one counts (each walks the GC's objects, ~0.1 s)
MAX_EMPTY_SCANS = 3


class ModelHook:
    """The roots found (`roots`: id -> where the batch is in its input), each root's first training call
    (`last_calls`: the probe's input), and what the optimizers' first steps described."""

    def __init__(self, inst: Watching) -> None:
        self.inst = inst
        self._roots: dict[int, int] = {}  # id of each root module -> where the batch is in its input
        self._root_refs: weakref.WeakValueDictionary[int, nn.Module] = weakref.WeakValueDictionary()
        self._discovered_on: set[str] = set()
        self._empty_scans = 0  # first scans that found no model yet (a trigger before it was built)
        # A root reached only through methods other than forward (a wrapper forwarding __getattr__, as Fabric's
        # does, then agent.get_action(x)): its submodules' outermost calls stand for its forwards (`_watch_entries`)
        self._entries: dict[int, nn.Module] = {}
        self._entry_patches: list[Callable[[], None]] = []  # the undo of each class watched for entries only
        self._in_entry = False
        # each root's first training call: (module, (args, kwargs)), the replay's input (probe.py)
        self.last_calls: dict[int, tuple[nn.Module, tuple[tuple[Any, ...], dict[str, Any]]]] = {}
        self._trained: list[nn.Module] = []  # the models seen training (`evaluating`)
        self._described: set[int] = set()  # the optimizers whose first step described their model
        self._parameters: dict[int, torch.Tensor] = {}  # described, by id (kept alive: ids stay unique)
        self._convs: set[int] = set()
        # where each outermost module was made, and last moved (`_watch_making`)
        self._made, self._moved = SiteMap(), SiteMap()

    def install(self, patch: Patch) -> None:
        """The no_grad/inference_mode blocks are a trigger to look for the model (a loop that only evaluates still
        finds it); the roots' classes are patched as they are found (`discover`)."""
        inst = self.inst
        self._watch_making(patch)
        for mode in (torch.no_grad, torch.inference_mode):
            enter = mode.__enter__

            def entered(ctx: Any, _enter: Callable[[Any], Any] = enter) -> Any:
                if inst.scanning and not _torch_caller(sys._getframe(1)):
                    self.discover("no_grad")  # (nn.init's no_grad, mid-construction, is not a trigger)
                return _enter(ctx)
            patch(mode, "__enter__", entered)

    def _watch_making(self, patch: Patch) -> None:
        """Where each outermost module is constructed (a model's submodules are made inside its own `__init__`:
        only a count, no walk of the stack) and where a module is last moved with `.to()`/`.cuda()`: the sites a
        layout or compile fix names (capture/sites.py)."""
        construct = nn.Module.__init__
        depth = [0]

        @functools.wraps(construct)
        def made(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            if depth[0] == 0 and (site := site_of("model", sys._getframe(1), owner=module)) is not None:
                self._made[module] = site
            depth[0] += 1
            try:
                construct(module, *args, **kwargs)
            finally:
                depth[0] -= 1
        patch(nn.Module, "__init__", made)
        for name in ("to", "cuda"):
            move = getattr(nn.Module, name)

            def moved(module: nn.Module, *args: Any, _move: Callable[..., Any] = move, **kwargs: Any) -> Any:
                site = site_of("to", sys._getframe(1))
                if site is not None:
                    self._moved[module] = site
                return _move(module, *args, **kwargs)
            patch(nn.Module, name, functools.wraps(move)(moved))

    def uninstall(self) -> None:
        """torch may keep our hooks (and so this) alive: never the script's models or batches."""
        self._roots.clear()
        self._parameters.clear()
        self._entries.clear()
        self.last_calls.clear()
        self._made.clear()
        self._moved.clear()

    def model_on(self, device: torch.device) -> None:
        observed = self.inst.observed
        observed.device = device.type
        observed.device_index = device.index if device.type == "cuda" else None
        self.inst.device_timer.saw_model(device)
        self.inst.events = self.inst.device_timer if self.inst.device_timer.device is not None else None

    def _saw_model(self, module: nn.Module) -> None:
        """The model's first training forward: where its parameters are, and whether it is compiled."""
        param = next(module.parameters(), None)
        if param is not None:
            self.inst.observed.compiled_model = type(module).__name__ == "OptimizedModule"  # without importing dynamo
            self.model_on(param.device)

    def saw_tensor(self, device: torch.device) -> None:
        self.inst.device_timer.saw_tensor(device)
        if self.inst.observed.device is None and self.inst.device_timer.device is not None:
            self.inst.observed.device, self.inst.observed.device_index = "cuda", self.inst.device_timer.device.index
        self.inst.events = self.inst.device_timer if self.inst.device_timer.device is not None else None

    def saw_batch(self, batch: Any) -> None:
        """A training batch before the model was seen: a loader that yields CUDA tensors is CUDA work."""
        leaf = first_leaf(batch)
        if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":  # (numpy arrays live on the host)
            self.saw_tensor(leaf.device)

    def discover(self, trigger: str) -> None:
        """Hook the root modules at the first batch, backward, optimizer step, sync or `no_grad()` block, and
        again when the first step closes: a module found mid-construction the first time (a `no_grad()` inside
        `nn.init`, a sync in `__init__`) is by then part of its model, which is the root. A first scan that finds
        no module at all (a trigger before any model was built) does not count, up to `MAX_EMPTY_SCANS` times."""
        if trigger == "step":
            if "step" in self._discovered_on:
                return
        elif self._discovered_on:
            return
        self._discovered_on.add(trigger)
        self.inst.scanning = "step" not in self._discovered_on
        started = perf_counter()
        # A module found the first time that is now inside a model drops out: its model is the root.
        self._roots.clear()
        self._root_refs.clear()
        for module in root_modules():
            if isinstance(module, torch.jit.ScriptModule):  # its __call__ is TorchScript's
                continue
            self._roots[id(module)] = batch_axis(module)
            self._root_refs[id(module)] = module
            self._watch_calls(type(module))
        self.inst.collectives.install(self.inst._patch)  # (once, and only once the script's process group is up)
        self.inst.collectives.saw_roots(self._root_refs.values())
        if trigger == "backward" and self._roots and not self.inst.timeline.training_forwards:
            # the first backward, the hooks put on its model only now: its forward ran unseen, before them
            self.inst.timeline.forwards += 1
            self.inst.timeline.training_forwards += 1
        if not self._roots and trigger != "step" and self._empty_scans < MAX_EMPTY_SCANS:
            self._empty_scans += 1  # no model exists yet: the next trigger scans again
            self._discovered_on.discard(trigger)
        if not self.inst.timeline.forwards:
            self._watch_entries()
        self.inst.doctor_time(perf_counter() - started, "scan")

    def _watch_entries(self) -> None:
        """No root was called yet: the loop may reach its model through other methods (a wrapper's `__getattr__`,
        `agent.get_action_and_value(x)`, as Fabric's PPO does). Watch the roots' submodules too, until a root is
        called: the outermost call of one stands for a forward of its root. Dropped at a root's first call: a
        watched class costs ~0.3 us per call of any of its instances."""
        self._entries.clear()
        root_classes = {type(root) for root in self._root_refs.values()}
        for root in list(self._root_refs.values()):
            for module in root.modules():
                if module is not root and not isinstance(module, torch.jit.ScriptModule):
                    self._entries[id(module)] = module
                    cls = type(module)
                    if cls not in root_classes and self._watch_calls(cls):
                        self._entry_patches.append(self.inst._undo[-1])

    def _drop_entries(self) -> None:
        """A root was called: its forwards are seen; the submodules' classes get their own __call__ back."""
        self._entries.clear()
        while self._entry_patches:
            undo = self._entry_patches.pop()
            undo()
            self.inst._undo.remove(undo)

    def _watch_calls(self, cls: type[nn.Module]) -> bool:
        """Wrap `cls.__call__` (once per class, inherited by subclasses): the roots' forwards go to `_on_forward`.

        Why not a forward pre-hook on each root: a module with hooks takes `_call_impl`'s slow path (~10 us per
        call here, 4 % of a tiny step), and `torch.save(model)` would pickle the hook and fail.
        """
        if getattr(cls.__call__, "_trainfast_watch", False):
            return False
        original = cls.__call__
        roots, on_forward = self._roots, self._on_forward

        entries = self._entries

        def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if id(module) in roots:
                if entries:
                    self._drop_entries()
                if on_forward(module, args, kwargs):  # an evaluation forward of a whole run: its end is timed
                    try:
                        return original(module, *args, **kwargs)
                    finally:
                        self.inst.ledger.eval_forward_end(perf_counter())  # type: ignore[union-attr]
            elif entries and id(module) in entries and not self._in_entry:
                on_forward(module, args, kwargs, root=False)
                self._in_entry = True  # its submodules' calls are inside this forward
                try:
                    return original(module, *args, **kwargs)
                finally:
                    self._in_entry = False
            return original(module, *args, **kwargs)
        call._trainfast_watch = True  # type: ignore[attr-defined]
        self.inst._patch(cls, "__call__", call)
        return True

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], root: bool = True) -> bool:
        """A root's forward begins (or a submodule's standing for it: `root` False): True when a whole run's ledger
        times it as evaluation."""
        inst = self.inst
        if inst.fetching or inst.paused:  # a module inside the dataset (a transform), not the model
            return False
        timeline = inst.timeline
        if not torch.is_grad_enabled():  # an evaluation pass, or a collection phase (timeline.py)
            if root and "evaluation" not in inst.observed.sites:
                self._saw_site("evaluation", module)
            now = perf_counter()
            timeline.evaluation_forward(now, module.training)
            return inst.ledger is not None and inst.ledger.eval_forward(now, module, args, kwargs, module.training,
                                                                        keep_call=root)
        if id(module) not in self.last_calls:  # (a lookup, not a store, per forward: ~0.1 us less per step)
            self.last_calls[id(module)] = (module, (args, kwargs))
            if module.training and any(p.requires_grad for p in module.parameters()):  # (a loss module has none)
                self._trained.append(module)
            self._saw_input_layout(args, kwargs)
            if root and "forward" not in inst.observed.sites:
                self._saw_site("forward", module)
        if not inst.device_timer.settled:
            self._saw_model(module)
        if timeline.loader_fed:  # batches come from a loader: its fetches start iterations and count samples
            timeline.forwards += 1
            timeline.training_forwards += 1
            return False
        first = args[0] if args else None
        timeline.forward(perf_counter(), self._input_samples(module, args, kwargs),
                         first if isinstance(first, torch.Tensor) else None)
        if inst.events is not None and timeline.in_measured_step:
            inst.events.batch_ready()
        return False

    def evaluating(self) -> bool:
        """Every model seen training (a root called with gradients on, in training mode, with trainable parameters)
        is now in eval mode: a batch fetched now feeds an evaluation pass even with gradients on (the HF Trainer's
        evaluation loop fetches outside its `no_grad`). A model that trains in eval mode throughout is never seen
        training this way, and its batches stay training batches. ~0.3 us a fetch."""
        trained = self._trained
        return bool(trained) and not any(m.training for m in trained)

    def _saw_site(self, what: str, module: nn.Module) -> None:
        """The script's line calling the model (its first training or evaluation forward), and, with the first
        training forward, where that model was made and last moved (`.to()`)."""
        sites = self.inst.observed.sites
        site = site_of(what, sys._getframe(2))
        if site is not None:
            sites[what] = site
        if what == "forward":
            for kind, where in (("model", self._made), ("to", self._moved)):
                found = where.get(module)
                if found is not None:
                    sites[kind] = found

    def _saw_input_layout(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The layout of a root's first 4-D floating input (once per root): a script that feeds channels_last images
        uses the practice, whatever its weights' strides say."""
        image = next((t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() == 4
                      and t.is_floating_point()), None)
        layout = memory_layout(image) if image is not None else None
        if layout in ("channels_last", "contiguous") and self.inst.observed.input_layout != "channels_last":
            self.inst.observed.input_layout = layout

    def _input_samples(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
        first = args[0] if args else None
        axis = self._roots.get(id(module), 0)
        if type(first) is torch.Tensor and first.ndim and not axis:  # the usual case, fast
            return int(first.shape[0])
        if axis:
            leaf = first_leaf((args, kwargs))
            if leaf is not None and leaf.ndim in (2, 3):  # (seq_len, batch[, features])
                return int(leaf.shape[1])
        return batch_samples((args, kwargs), 0)

    def describe_model(self, optimizer: torch.optim.Optimizer) -> None:
        """At each optimizer's first step: the parameters it trains and the convolutions of their models, added to
        what earlier optimizers described (a GAN's generator and discriminator have one each)."""
        observed = self.inst.observed
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not params:
            return
        first = not self._described
        self._described.add(id(optimizer))
        if first:
            self.model_on(params[0].device)
            observed.threads = torch.get_num_threads()
        new = [p for p in params if id(p) not in self._parameters]
        self._parameters.update((id(p), p) for p in new)
        observed.parameters += sum(p.numel() for p in new)
        observed.parameter_dtypes.update(str(p.dtype).replace("torch.", "") for p in new if p.is_floating_point())
        # the convolutions of the models this optimizer trains, frozen ones too: channels_last speeds them all up
        stepped = {id(p) for p in params}
        models = [m for m in self._root_refs.values() if any(id(p) in stepped for p in m.parameters())]
        weights = [p for m in models for p in m.parameters()] if models else params
        convs = [p for p in weights if p.dim() == 4 and math.prod(p.shape[2:]) > 1 and id(p) not in self._convs]
        self._convs.update(id(p) for p in convs)
        observed.conv_weights += len(convs)
        for p in convs:
            layout = memory_layout(p)
            if layout == "channels_last":
                observed.conv_weights_channels_last += 1
            elif layout == "ambiguous":
                observed.conv_weights_ambiguous += 1


def memory_layout(t: torch.Tensor) -> str:
    """A 4-D tensor's layout: "channels_last", "contiguous" (NCHW), "ambiguous" (strides that fit both: a dimension
    of size 1 where it decides) or "strided" (neither)."""
    nchw, nhwc = t.is_contiguous(), t.is_contiguous(memory_format=torch.channels_last)
    return "ambiguous" if nchw and nhwc else "contiguous" if nchw else "channels_last" if nhwc else "strided"


def _torch_caller(frame: Any) -> bool:
    """The code that entered a no_grad/inference_mode block is torch's own: the frame, or, for a function decorated
    with `@torch.no_grad()` (nanoGPT's `estimate_loss`), the frame that called the decorated function."""
    if frame.f_globals.get("__name__") == "torch.utils._contextlib" and frame.f_back is not None:
        frame = frame.f_back
    return bool(frame.f_globals.get("__name__", "").startswith("torch"))


def root_modules() -> list[nn.Module]:
    """Every live module with parameters that is no other module's child: the models a script calls (loss and
    metric modules hold no parameters)."""
    with warnings.catch_warnings():  # type() rather than isinstance(): some lazy torch objects warn on __class__
        warnings.simplefilter("ignore")
        modules = [o for o in gc.get_objects() if issubclass(type(o), nn.Module)]
    children: set[int] = set()
    for module in modules:
        children.update(id(c) for c in vars(module).get("_modules", {}).values() if c is not None)
    return [m for m in modules if id(m) not in children and not _compile_internal(m) and _has_parameters(m)]


def _compile_internal(module: nn.Module) -> bool:
    """torch.fx / dynamo's graph modules: torch.compile's insides, called within the compiled frame. The
    `OptimizedModule` that torch.compile returns is the model the script calls, and stays."""
    name = type(module).__module__
    return name.startswith(("torch.fx", "torch._")) and type(module).__name__ != "OptimizedModule"


def batch_axis(model: nn.Module) -> int:
    """Where the batch is in the model's (2- or 3-D) input: 1 for a time-major sequence model, whose first RNN or
    Transformer layer is not `batch_first` (PyTorch's word-language-model example feeds (seq_len, batch) token
    ids), else 0."""
    try:
        for m in model.modules():
            if isinstance(m, nn.RNNBase):
                return 0 if m.batch_first else 1
            if isinstance(m, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
                return 0 if m.self_attn.batch_first else 1
    except Exception:  # a module with its own modules(): assume batch first
        return 0
    return 0


def _has_parameters(module: nn.Module) -> bool:
    try:
        return next(module.parameters(), None) is not None
    except Exception:  # a module left half-built by a failed __init__, or with its own parameters(): not ours
        return False
