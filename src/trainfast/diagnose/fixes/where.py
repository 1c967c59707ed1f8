"""Where each fix is made permanent (`locate`): the line of the script's own code that made or called what the fix
changes (the capture's sites, capture/sites.py: the DataLoader call, the model's creation or `.to()`, its training
call, the autocast block, the evaluation's call, the checkpoint write), the first of the rule's `changes` seen; and
where a framework made it on the script's behalf, that framework's own setting for the fix (`SETTINGS`), since the
line that would change is inside the framework, not the user's code.

The settings are the frameworks' documented options (HF `TrainingArguments`, Lightning's `Trainer` and its
`AsyncCheckpointIO` plugin, timm's train.py flags, accelerate's `Accelerator`); `{key}` takes the fix's override."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from trainfast.diagnose.evidence.evidence import Evidence
from trainfast.diagnose.fixes.rule import RULES
from trainfast.diagnose.records.capture import Site
from trainfast.diagnose.records.findings import Recommendation, Where
from trainfast.diagnose.records.steps import main_loader

_LOADER_HF = "TrainingArguments(dataloader_num_workers={num_workers}, dataloader_persistent_workers=True)"
_LOADER_LIGHTNING = "the DataLoader your LightningModule's or DataModule's train_dataloader() returns"
_LOADER_ACCELERATE = "the DataLoader you pass to accelerator.prepare()"
SETTINGS: dict[str, dict[str, str]] = {
    "transformers": {
        "num_workers": _LOADER_HF,
        "persistent_workers": "TrainingArguments(dataloader_persistent_workers=True)",
        "pin_memory": "TrainingArguments(dataloader_pin_memory=True)",
        "prefetch_factor": "TrainingArguments(dataloader_prefetch_factor={prefetch_factor})",
        "amp": "TrainingArguments(bf16=True)",
        "fp32": "TrainingArguments(bf16=False, fp16=False)",
        "compile": "TrainingArguments(torch_compile=True)",
        "eval_autocast": "TrainingArguments(bf16_full_eval=True)",
        "eval_less_often": "TrainingArguments(eval_steps=...) twice as many, or eval_strategy='epoch'",
        "async_checkpoint": "TrainingArguments(save_steps=...) less often: the HF Trainer writes its checkpoints "
                            "synchronously",
        "batch_size": "TrainingArguments(per_device_train_batch_size=...)",
        "channels_last": "no TrainingArguments setting: model.to(memory_format=torch.channels_last) before "
                         "Trainer(model=model)",
    },
    "lightning": {
        "num_workers": f"{_LOADER_LIGHTNING}: DataLoader(..., num_workers={{num_workers}}, persistent_workers=True)",
        "persistent_workers": f"{_LOADER_LIGHTNING}: DataLoader(..., persistent_workers=True)",
        "pin_memory": f"{_LOADER_LIGHTNING}: DataLoader(..., pin_memory=True)",
        "prefetch_factor": f"{_LOADER_LIGHTNING}: DataLoader(..., prefetch_factor={{prefetch_factor}})",
        "amp": "Trainer(precision='bf16-mixed')",
        "fp32": "Trainer(precision='32-true')",
        "compile": "model = torch.compile(model) before trainer.fit(model)",
        "eval_autocast": "Trainer(precision='bf16-mixed'): evaluation runs under it too",
        "eval_less_often": "Trainer(val_check_interval=..., limit_val_batches=...)",
        "async_checkpoint": "Trainer(plugins=[AsyncCheckpointIO()])",
        "channels_last": "self.to(memory_format=torch.channels_last) in your LightningModule's setup()",
    },
    "timm": {
        "num_workers": "--workers {num_workers}",
        "pin_memory": "--pin-mem",
        "amp": "--amp --amp-dtype bfloat16",
        "fp32": "drop --amp",
        "channels_last": "--channels-last",
        "contiguous": "drop --channels-last",
        "compile": "--torchcompile",
        "batch_size": "--batch-size",
    },
    "accelerate": {
        "num_workers": f"{_LOADER_ACCELERATE}: DataLoader(..., num_workers={{num_workers}}, persistent_workers=True)",
        "persistent_workers": f"{_LOADER_ACCELERATE}: DataLoader(..., persistent_workers=True)",
        "pin_memory": f"{_LOADER_ACCELERATE}: DataLoader(..., pin_memory=True)",
        "amp": "Accelerator(mixed_precision='bf16'), or accelerate launch --mixed_precision bf16",
        "fp32": "Accelerator(mixed_precision='no')",
        "compile": "Accelerator(dynamo_backend='inductor'), or accelerate launch --dynamo_backend inductor",
    },
}


class _Overrides(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return "..."


def setting(framework: str, fix_id: str, overrides: Mapping[str, Any] | None) -> str:
    """The framework's own setting for the fix, or, where it has none we know, what to look for."""
    text = SETTINGS.get(framework, {}).get(fix_id)
    if text is None:
        return f"made inside {framework}: set it where {framework} takes its options for this"
    return text.format_map(_Overrides(overrides or {}))


def _site(changes: Iterable[str], e: Evidence, sites: Iterable[Site]) -> Site | None:
    """The first site of the rule's `changes` the script has; of its loaders, the training loader's."""
    by_what: dict[str, Site] = {}
    loader = main_loader(e.loaders)
    for site in sites:
        if site.what == "loader" and loader is not None and site.index != loader.index:
            continue
        by_what.setdefault(site.what, site)
    return next((by_what[what] for what in changes if what in by_what), None)


def locate(recommendations: Iterable[Recommendation], e: Evidence, sites: Iterable[Site]) -> list[Recommendation]:
    """Each fix with its `where`, where the capture saw what its rule changes (`Rule.changes`)."""
    changes = {rule.id: rule.changes for rule in RULES}
    sites = tuple(sites)
    located = []
    for r in recommendations:
        site = _site(changes.get(r.id, ()), e, sites)
        if site is not None:
            r = replace(r, where=Where(site.what, site.file, site.line, site.code, site.framework,
                                       setting(site.framework, r.id, r.overrides) if site.framework else None))
        located.append(r)
    return located
