"""The JPEG decode path `ImageFolder` and `PackedImages` share: bytes to a uint8 CHW crop, built for throughput.

Three choices make it fast (figures from the demo images, 300-500 px, one core):
- Decode with Pillow's `draft()`: libjpeg scales by 1/2, 1/4 or 1/8 inside the DCT, so a 400 px
  image cropped and trained at 64 px decodes several times faster than a full decode. The scale is
  picked per sample so that the crop region is still at least the output size: no quality is lost
  relative to decoding in full and then shrinking.
- Resize the crop with torch's uint8 antialiased bilinear kernel (Pillow's filter, 3x as fast: 0.23 vs
  0.72 ms at 224 px); `decode="full"`, the reference, keeps Pillow's resize.
- Return **uint8** CHW tensors: 4x fewer bytes through worker queues and host-to-device copies than
  float32; conversion and normalisation happen on the device (`DevicePrefetcher`).

JPEG backend: with `decode="draft"`, JPEGs are decoded by simplejpeg (the `fastjpeg` extra) where it is installed
and measures faster than Pillow in this process, else by Pillow: same DCT scale, crop, flip and uint8 output. The
choice is made once per process, at the first JPEG decoded: both decode a small synthetic JPEG in memory at that
call's image size (a few ms; no file read, Python's `random` untouched) and simplejpeg is used only if it is
decided at least 5 % faster (trainfast.decide, each interleaved pair a pair); the figures are logged once at INFO.
The environment variable `TRAINFAST_JPEG=pillow|simplejpeg|auto` (default auto) forces it. `decode="full"` and
non-JPEG files (PNG, ...) always use Pillow.

Random crops and flips draw from `batch_rngs().random`, so a batch is the same with every loader backend.
"""

from __future__ import annotations

import errno
import importlib
import io
import logging
import math
import os
import statistics
import time
from typing import Any, BinaryIO

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from trainfast.decide import STEP_NOISE, decide
from trainfast.loader.seeding import batch_rngs

# The process is out of a resource, the file is not broken: these propagate as they are (the loader's
# LoaderError explains them) instead of counting as a corrupt image.
RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})

log = logging.getLogger("trainfast")

JPEG_ENV = "TRAINFAST_JPEG"  # pillow | simplejpeg | auto: which library decodes JPEGs with decode="draft"
JPEG_BACKENDS = ("pillow", "simplejpeg", "auto")
JPEG_MIN_GAIN = 0.05  # auto: simplejpeg only if decided at least this much faster than Pillow (trainfast.decide)
_jpeg_backend: str | None = None  # "pillow" or "simplejpeg" once decided (once per process, at the first JPEG)
_simplejpeg: Any = None  # the simplejpeg module when it is the backend


def image_sample_bytes(image_size: int) -> int:
    """Bytes of one collated sample: the uint8 3 x image_size x image_size image and its int64 label."""
    return 3 * image_size * image_size + 8


class CorruptImageError(RuntimeError):
    """An image file could not be decoded; the message names the file."""


def decode_image(source: str | BinaryIO, name: str, *, image_size: int, train: bool, decode: str = "draft",
                 crop_scale: tuple[float, float] = (0.35, 1.0), center_fraction: float = 0.875) -> torch.Tensor:
    """One image file (a path or an open binary file) as a uint8 CHW `image_size` x `image_size` tensor: the
    decode, crop, flip and conversion `ImageFolder` and `PackedImages` share (train: random-resized crop and flip
    drawn from `batch_rngs().random`; eval: centre crop). A file that cannot be decoded raises `CorruptImageError`
    naming `name`; running out of open files or memory propagates as it is."""
    box: Box | None = None
    img: torch.Tensor | None = None
    try:
        if decode == "draft" and jpeg_backend(image_size) == "simplejpeg":
            if isinstance(source, str):
                with open(source, "rb") as f:
                    data = f.read()
            else:
                data = source.read()
            if data[:3] == b"\xff\xd8\xff":  # a JPEG
                img, box = _simplejpeg_crop_resize(data, image_size, train, crop_scale, center_fraction)
            source = io.BytesIO(data)
        if img is None:  # Pillow: not a JPEG, not the backend, or data simplejpeg refused (Pillow then decides)
            with Image.open(source) as im:
                img = _crop_resize(im, image_size, train, decode, crop_scale, center_fraction, box)
    except OSError as e:
        if e.errno in RESOURCE_ERRNOS:
            raise
        raise CorruptImageError(f"cannot decode image {name!r}: {e}") from e
    except (SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise CorruptImageError(f"cannot decode image {name!r}: {e}") from e
    return img


Box = tuple[float, float, float, float, bool]  # crop x, y, width, height in the stored image; flip


def _crop_box(w: int, h: int, s: int, train: bool, crop_scale: tuple[float, float],
              center_fraction: float) -> Box:
    if train:
        x0, y0, cw, ch = _random_crop(w, h, crop_scale)
        return x0, y0, cw, ch, batch_rngs().random.random() < 0.5
    side = min(w, h) * center_fraction  # resize the short side to s / fraction, then centre crop s x s
    return (w - side) / 2, (h - side) / 2, side, side, False


def _draft_size(w: int, h: int, s: int, cw: float, ch: float) -> tuple[int, int]:
    """The size asked of the DCT scaling: the crop stays at least s x s, so the image is >= (w, h) * s / crop."""
    return math.ceil(w * s / cw), math.ceil(h * s / ch)


def _crop_resize(im: Image.Image, s: int, train: bool, decode: str, crop_scale: tuple[float, float],
                 center_fraction: float, box: Box | None = None) -> torch.Tensor:
    w, h = im.size
    x0, y0, cw, ch, flip = box or _crop_box(w, h, s, train, crop_scale, center_fraction)
    if decode != "draft":  # the reference: Pillow's resize, as torchvision's PIL transforms do it
        return _finish_pillow(im, s, w, h, (x0, y0, cw, ch, flip))
    if im.format == "JPEG":
        im.draft("RGB", _draft_size(w, h, s, cw, ch))  # the largest DCT scale (1/8 to 1) that still covers it
    return _finish(im, s, w, h, (x0, y0, cw, ch, flip))


def _finish_pillow(im: Image.Image, s: int, w: int, h: int, box: Box) -> torch.Tensor:
    """Crop `box` (in the stored w x h image's pixels) of `im` to s x s with Pillow's resize; flip; uint8 CHW."""
    x0, y0, cw, ch, flip = box
    fx, fy = im.size[0] / w, im.size[1] / h
    x0, y0, cw, ch = x0 * fx, y0 * fy, cw * fx, ch * fy
    if im.mode != "RGB":
        im = im.convert("RGB")
    out = im.resize((s, s), Image.Resampling.BILINEAR, box=(x0, y0, x0 + cw, y0 + ch))
    if flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return torch.from_numpy(np.array(out, dtype=np.uint8)).permute(2, 0, 1)  # a writable copy: torch needs one


def _finish(im: Image.Image | np.ndarray, s: int, w: int, h: int, box: Box) -> torch.Tensor:
    """Crop `box` (in the stored w x h image's pixels) of `im` (maybe decoded smaller; an HWC uint8 array or a
    Pillow image) to s x s; flip; uint8 CHW. The crop is rounded to whole pixels and resized by torch's uint8
    bilinear (antialiased) kernel, the same filter as Pillow's resize and 3x as fast here (224 px: 0.23 vs 0.72 ms,
    as long as the decode itself). Pixels differ from Pillow's fractional crop by 0.03 on average at 224 px and by
    0.8 at 64 px, where a whole pixel of the DCT-scaled image is a larger shift."""
    if isinstance(im, Image.Image):
        im = np.asarray(im if im.mode == "RGB" else im.convert("RGB"))
    x0, y0, cw, ch, flip = box
    fx, fy = im.shape[1] / w, im.shape[0] / h
    left, top = min(round(x0 * fx), im.shape[1] - 1), min(round(y0 * fy), im.shape[0] - 1)
    right, bottom = max(round((x0 + cw) * fx), left + 1), max(round((y0 + ch) * fy), top + 1)
    region = im[top:bottom, left:right]
    if not (region.flags.writeable and region.flags.c_contiguous):  # torch wants a writable buffer, the fast
        region = region.copy()                                         # kernel a contiguous channels-last one
    crop = torch.from_numpy(region).permute(2, 0, 1)[None]
    out = F.interpolate(crop, size=(s, s), mode="bilinear", antialias=True, align_corners=False)[0]
    return out.flip(-1) if flip else out


def _simplejpeg_crop_resize(data: bytes, s: int, train: bool, crop_scale: tuple[float, float],
                            center_fraction: float) -> tuple[torch.Tensor | None, Box | None]:
    """`_crop_resize` with decode="draft" by simplejpeg: the same random draws, DCT scale, crop and flip. Returns
    (None, box or None) for data simplejpeg refuses (corrupt, or CMYK), so Pillow decodes it, or raises, with the
    same box (the random draws are not repeated)."""
    try:
        h, w, colorspace, _ = _simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return None, None  # before any random draw: Pillow starts afresh
    if colorspace not in ("YCbCr", "Gray", "RGB"):  # CMYK / YCCK: Pillow's conversion
        return None, None
    if Image.MAX_IMAGE_PIXELS and w * h > Image.MAX_IMAGE_PIXELS:  # Pillow's decompression-bomb warning or error
        return None, None
    box = _crop_box(w, h, s, train, crop_scale, center_fraction)
    dw, dh = _draft_size(w, h, s, box[2], box[3])
    # Pillow's draft picks 1/k, k in 8, 4, 2, 1; simplejpeg would also take k/8 scales, so ask for what draft decodes
    k = next((k for k in (8, 4, 2) if min(w // dw, h // dh) >= k), 1)
    try:
        arr = _simplejpeg.decode_jpeg(data, "rgb", min_width=-(-w // k), min_height=-(-h // k))
    except ValueError:
        return None, box
    return _finish(arr, s, w, h, box), box


def jpeg_backend(image_size: int = 224) -> str:
    """"pillow" or "simplejpeg": which library decodes JPEGs with decode="draft" in this process, decided once, at
    the first call (auto: timed at that call's `image_size`, as the DCT scale, and so the winner, depends on it)."""
    global _jpeg_backend, _simplejpeg
    if _jpeg_backend is None:
        _jpeg_backend, _simplejpeg = _choose_jpeg_backend(image_size)
    return _jpeg_backend


def _choose_jpeg_backend(image_size: int) -> tuple[str, Any]:
    wanted = os.environ.get(JPEG_ENV, "auto").strip().lower() or "auto"
    if wanted not in JPEG_BACKENDS:
        log.warning("%s=%r is not valid (%s); using auto", JPEG_ENV, wanted, "|".join(JPEG_BACKENDS))
        wanted = "auto"
    if wanted == "pillow":
        return "pillow", None
    try:
        module = importlib.import_module("simplejpeg")
    except ImportError:
        if wanted == "simplejpeg":
            log.warning("%s=simplejpeg but simplejpeg is not installed (pip install 'trainfast[fastjpeg]'); "
                        "using Pillow", JPEG_ENV)
        return "pillow", None
    if wanted == "simplejpeg":
        return "simplejpeg", module
    pil_s, sj_s = _time_jpeg_backends(module, image_size)
    # each interleaved Pillow/simplejpeg pair is a pair of the one decision, at the noise of in-process timings
    decision = decide([1 / t for t in pil_s], [1 / t for t in sj_s], threshold=1 + JPEG_MIN_GAIN, noise=STEP_NOISE)
    choice = "simplejpeg" if decision.faster else "pillow"
    log.info("jpeg decode: simplejpeg %.2f ms vs Pillow %.2f ms per image here (%d px; %s) -> %s (%s=pillow|"
             "simplejpeg forces it)", statistics.median(sj_s) * 1e3, statistics.median(pil_s) * 1e3, image_size,
             decision.said("Pillow", "simplejpeg"), choice, JPEG_ENV)
    return choice, module


def _time_jpeg_backends(module: Any, s: int, repeats: int = 8) -> tuple[list[float], list[float]]:
    """Seconds per decode (Pillow's, simplejpeg's, `repeats` of each) of a synthetic 480 x 360 JPEG to an s x s
    centre crop, eval mode (no random draws, so seeded crops are unchanged), interleaved, after one warm-up each."""
    yy, xx = np.mgrid[0:360, 0:480]
    rng = np.random.default_rng(0)
    pixels = np.stack([xx * 255 // 479, yy * 255 // 359, (xx + yy) % 256], axis=-1) + rng.integers(0, 32, (360, 480, 3))
    buf = io.BytesIO()
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    global _simplejpeg
    saved, _simplejpeg = _simplejpeg, module
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for i in range(repeats + 1):
            for backend, out in zip((False, True), times, strict=True):
                t = time.perf_counter()
                if backend:
                    _simplejpeg_crop_resize(data, s, False, (1.0, 1.0), 0.875)
                else:
                    with Image.open(io.BytesIO(data)) as im:
                        _crop_resize(im, s, False, "draft", (1.0, 1.0), 0.875)
                if i:
                    out.append(time.perf_counter() - t)
    finally:
        _simplejpeg = saved
    return times


def _random_crop(w: int, h: int, scale: tuple[float, float]) -> tuple[float, float, float, float]:
    """Random-resized-crop box (x, y, width, height): area fraction in `scale`, aspect in [3/4, 4/3]."""
    area, rng = w * h, batch_rngs().random
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = math.sqrt(target * aspect), math.sqrt(target / aspect)
        if cw <= w and ch <= h:
            return rng.uniform(0, w - cw), rng.uniform(0, h - ch), cw, ch
    side = min(w, h)  # fallback as torchvision: the largest centred square
    return (w - side) / 2, (h - side) / 2, side, side
