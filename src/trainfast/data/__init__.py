"""Datasets and reference models: the demo images, a fast ImageFolder reader, packed JPEG shards (`pack`,
`PackedImages`), small models by name."""

from trainfast.data.decode import CorruptImageError
from trainfast.data.images import ImageFolder
from trainfast.data.models import MODELS, build_model
from trainfast.data.packed import PackedImages
from trainfast.data.packing import PackResult, pack
from trainfast.data.synthetic import ensure_demo_dataset
from trainfast.loader.prefetch import Normalize

__all__ = ["MODELS", "CorruptImageError", "ImageFolder", "Normalize", "PackResult", "PackedImages", "build_model",
           "ensure_demo_dataset", "pack"]
