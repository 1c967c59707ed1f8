"""`trainfast train ARGS` on a volume that fills up at torch.save's CALL-th save to a file, where torch's zip writer
raises RuntimeError(MESSAGE) (the fake in tests/conftest.py). Usage: train_full_volume.py CALL MESSAGE ARGS..."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, whose conftest holds the fake
from conftest import torch_save_full_from
from trainfast.cli import main

call, message = int(sys.argv[1]), sys.argv[2]
torch.save = torch_save_full_from(call, lambda: RuntimeError(message))
sys.exit(main(sys.argv[3:]))
