"""speculators' ``Trainer`` on any single device, CPU included, and a JSON-lines metrics log.

speculators 0.9's trainer assumes an accelerator in three places; :class:`DraftTrainer` replaces
exactly those and nothing else:

* ``speculators.train.trainer.Trainer.local_rank`` (an int, moved to as ``cuda:<rank>``) -> our device;
* ``speculators.train.trainer._StepTimer`` (calls ``torch.accelerator.synchronize()``, which raises
  on hosts without a GPU) -> :class:`_HostStepTimer` while an epoch runs on the CPU;
* ``speculators.train.checkpointer.SingleGPUCheckpointer`` (resumes onto ``get_current_device()``,
  ``cuda:0`` without an accelerator) -> :class:`DeviceCheckpointer`.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
from speculators.train import trainer as speculators_trainer
from speculators.train.checkpointer import (
    SingleGPUCheckpointer,
    convert_float_dtype,
    load_safetensors_state_dict,
)
from speculators.train.trainer import Trainer, TrainerConfig

METRICS_LOGGER = "speculators.metrics"

__all__ = ["DraftTrainer", "MetricsJsonl", "TrainerConfig"]


class _HostStepTimer(speculators_trainer._StepTimer):
    """speculators' step timer without device synchronisation (nothing to wait for on the CPU)."""

    def mark(self, name: str) -> None:
        if self.enabled:
            self._marks[name] = time.perf_counter()

    def now(self) -> float | None:
        return time.perf_counter() if self.enabled else None


class DeviceCheckpointer(SingleGPUCheckpointer):
    """speculators' single-process checkpoints (``<epoch>/model.safetensors``, optimizer and
    scheduler states), resumed onto ``device``."""

    def __init__(self, path: Path | str, device: torch.device):
        super().__init__(path)
        self.device = device

    def load_model_state_dict(self, model, float_dtype: torch.dtype | None = None):
        state = load_safetensors_state_dict(self.model_path(self.previous_epoch), str(self.device))
        model.load_state_dict(convert_float_dtype(state, float_dtype or model.dtype), strict=False)

    def load_optimizer_state_dict(self, model, optimizer, float_dtype: torch.dtype | None = None):
        loaded = torch.load(
            self.optimizer_path(self.previous_epoch), weights_only=True, map_location=self.device
        )
        optimizers = optimizer if isinstance(optimizer, list | tuple) else [optimizer]
        loaded = loaded if isinstance(loaded, list) else [loaded]
        for opt, state in zip(optimizers, loaded, strict=True):
            opt.load_state_dict(convert_float_dtype(state, float_dtype or model.dtype))


class DraftTrainer(Trainer):
    """speculators' ``Trainer`` (epochs, AdamW, warmup + cosine schedule, gradient clipping at 1.0,
    tqdm progress, validation, checkpoints, resume) on one ``device``."""

    def __init__(self, model, config: TrainerConfig, train_loader, val_loader, device: torch.device):
        self.device = torch.device(device)
        super().__init__(model, config, train_loader, val_loader)

    def setup_trainer(self):
        self.local_rank = self.device  # speculators moves the model and every batch with .to(self.local_rank)
        self.device_type = self.device.type
        self.checkpointer = DeviceCheckpointer(self.config.save_path, self.device)
        super().setup_trainer()

    @contextmanager
    def _on_host(self):
        if self.device.type != "cpu":
            yield
            return
        with mock.patch.object(speculators_trainer, "_StepTimer", _HostStepTimer), warnings.catch_warnings():
            # speculators autocasts to hidden_states_dtype; an fp32 "autocast" on the CPU is a no-op
            warnings.filterwarnings("ignore", message="CPU Autocast only supports")
            warnings.filterwarnings(
                "ignore", message="In CPU autocast, but the target dtype is not supported"
            )
            warnings.filterwarnings("ignore", message=".*pin_memory.*")
            yield

    def train_epoch(self, epoch: int, **kwargs):
        with self._on_host():
            return super().train_epoch(epoch, **kwargs)

    def val_epoch(self, epoch: int):
        with self._on_host():
            return super().val_epoch(epoch)


class MetricsJsonl(logging.Handler):
    """Appends each record of the ``speculators.metrics`` logger (a dict) to a JSON-lines file."""

    def __init__(self, path: str | Path):
        super().__init__(logging.INFO)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, dict):
            return
        entry = {"step": getattr(record, "step", None), **record.msg}
        self.records.append(entry)
        with self.path.open("a") as f:
            f.write(json.dumps(entry, default=float) + "\n")

    def __enter__(self) -> MetricsJsonl:
        log = logging.getLogger(METRICS_LOGGER)
        self._saved = (log.level, log.propagate)
        log.setLevel(logging.INFO)
        log.propagate = False  # the dicts go to the file, not the console
        log.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        log = logging.getLogger(METRICS_LOGGER)
        log.removeHandler(self)
        log.level, log.propagate = self._saved
