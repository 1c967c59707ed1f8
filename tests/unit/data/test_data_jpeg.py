"""simplejpeg and Pillow as JPEG decoders (`decode="draft"`): same crop, shape, dtype and pixels; same errors."""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import trainfast.data.decode as decode
from trainfast.data.decode import CorruptImageError, decode_image

simplejpeg = pytest.importorskip("simplejpeg", reason="simplejpeg is not installed (pip install 'trainfast[fastjpeg]')")

# The two libraries bundle libjpeg-turbo with the same IDCT (islow) and fancy upsampling: here the outputs are
# identical (mean and max difference 0 over the demo images at 32-224 px). A mean of 1 grey level leaves room for
# other libjpeg-turbo builds, and is far below what a wrong crop, scale or flip gives (tens of levels).
MEAN_ABS_TOLERANCE = 1.0
SIZES = [(470, 380), (300, 500), (1024, 256), (97, 61)]  # landscape, portrait, very wide, smaller than the output


def _set_backend(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    monkeypatch.setattr(decode, "_jpeg_backend", backend)
    monkeypatch.setattr(decode, "_simplejpeg", simplejpeg if backend == "simplejpeg" else None)


def _jpeg(path: Path, w: int, h: int, *, grey: bool = False) -> Path:
    yy, xx = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(w * h)
    pixels = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx ^ yy) % 256], axis=-1)
    pixels = (pixels + rng.integers(0, 24, (h, w, 3))).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    (image.convert("L") if grey else image).save(path, "JPEG", quality=90)
    return path


def _decode_both(monkeypatch: pytest.MonkeyPatch, source: Path, seed: int, **kwargs: object) -> dict[str, torch.Tensor]:
    out = {}
    for backend in ("pillow", "simplejpeg"):
        _set_backend(monkeypatch, backend)
        random.seed(seed)
        out[backend] = decode_image(str(source), str(source), **kwargs)  # type: ignore[arg-type]
        out[backend + " next draw"] = torch.tensor(random.random())  # the same number of random draws
    return out


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("image_size", [224, 64, 24])
@pytest.mark.usefixtures("saved_rngs")
def test_both_backends_give_the_same_sample(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, train: bool,
                                            image_size: int) -> None:
    for i, (w, h) in enumerate(SIZES):
        path = _jpeg(tmp_path / f"{w}x{h}.jpg", w, h, grey=i == 3)
        for seed in range(3):
            out = _decode_both(monkeypatch, path, seed, image_size=image_size, train=train)
            pil, sj = out["pillow"], out["simplejpeg"]
            assert pil.shape == sj.shape == (3, image_size, image_size)
            assert pil.dtype == sj.dtype == torch.uint8
            diff = (pil.float() - sj.float()).abs().mean().item()
            assert diff <= MEAN_ABS_TOLERANCE, f"{w}x{h} seed {seed}: mean abs difference {diff:.2f}"
            assert out["pillow next draw"] == out["simplejpeg next draw"]


@pytest.mark.usefixtures("saved_rngs")
def test_simplejpeg_decodes_at_the_scale_draft_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1024 px image at 32 px, eval: draft decodes at 1/8, simplejpeg is asked for the same (not 3/8 etc.)."""
    path = _jpeg(tmp_path / "big.jpg", 1024, 768)
    asked: list[tuple[int, int]] = []
    real = simplejpeg.decode_jpeg

    def spy(data: bytes, *args: object, **kwargs: int) -> np.ndarray:
        result = real(data, *args, **kwargs)
        asked.append(result.shape[:2])
        return result  # type: ignore[no-any-return]

    _set_backend(monkeypatch, "simplejpeg")
    monkeypatch.setattr(simplejpeg, "decode_jpeg", spy)
    decode_image(str(path), "big.jpg", image_size=32, train=False)
    with Image.open(path) as im:
        im.draft("RGB", (1024 * 32 // 672 + 1, 768 * 32 // 672 + 1))
        assert asked == [(im.size[1], im.size[0])] == [(96, 128)]


@pytest.mark.usefixtures("saved_rngs")
def test_flat_region_and_flip_land_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Left half black, right half white: a crop or flip that differed would move the edge by many columns."""
    pixels = np.zeros((400, 600, 3), np.uint8)
    pixels[:, 300:] = 255
    path = tmp_path / "halves.jpg"
    Image.fromarray(pixels).save(path, "JPEG", quality=95)
    flips = set()
    for seed in range(12):
        out = _decode_both(monkeypatch, path, seed, image_size=64, train=True)
        pil_cols, sj_cols = (out[b].float().mean(dim=(0, 1)) > 127 for b in ("pillow", "simplejpeg"))
        assert torch.equal(pil_cols, sj_cols), f"seed {seed}"
        flips.add(bool(pil_cols[0]))  # white on the left: flipped (or a crop wholly in the white half)
    assert flips == {False, True}


@pytest.mark.parametrize("backend", ["pillow", "simplejpeg"])
@pytest.mark.usefixtures("saved_rngs")
def test_truncated_jpeg_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    data = _jpeg(tmp_path / "whole.jpg", 470, 380).read_bytes()
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / "garbage.jpg"
    garbage.write_bytes(b"\xff\xd8\xff" + b"not a jpeg" * 20)
    _set_backend(monkeypatch, backend)
    for path in (broken, garbage):
        for train in (False, True):
            with pytest.raises(CorruptImageError, match=path.name):
                decode_image(str(path), str(path), image_size=64, train=train)
    with pytest.raises(CorruptImageError, match="packed#3"):  # an open binary file, as PackedImages passes
        decode_image(io.BytesIO(data[:-2000]), "packed#3", image_size=64, train=False)


@pytest.mark.usefixtures("saved_rngs")
def test_png_stays_on_pillow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.png"
    Image.fromarray(np.full((90, 120, 3), 7, np.uint8)).save(path)
    _set_backend(monkeypatch, "simplejpeg")
    monkeypatch.setattr(simplejpeg, "decode_jpeg", lambda *a, **k: pytest.fail("simplejpeg decoded a PNG"))
    out = decode_image(str(path), "a.png", image_size=32, train=True)
    assert out.shape == (3, 32, 32) and out.dtype == torch.uint8 and int(out.max()) == 7


@pytest.mark.parametrize(("env", "expected"), [("pillow", "pillow"), ("simplejpeg", "simplejpeg"),
                                               ("PilloW ", "pillow")])
def test_environment_variable_forces_the_backend(monkeypatch: pytest.MonkeyPatch, env: str, expected: str) -> None:
    monkeypatch.setenv("TRAINFAST_JPEG", env)
    monkeypatch.setattr(decode, "_jpeg_backend", None)
    monkeypatch.setattr(decode, "_simplejpeg", None)
    assert decode.jpeg_backend(64) == expected
    assert decode.jpeg_backend(224) == expected  # decided once


def test_auto_times_both_and_logs_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TRAINFAST_JPEG", "auto")
    monkeypatch.setattr(decode, "_jpeg_backend", None)
    monkeypatch.setattr(decode, "_simplejpeg", None)
    state = random.getstate()
    with caplog.at_level(logging.INFO, logger="trainfast"):
        choice = decode.jpeg_backend(64)
        decode.jpeg_backend(64)
    assert random.getstate() == state  # the timing draws nothing: seeded crops are unchanged
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("jpeg decode:")]
    assert len(lines) == 1 and lines[0].endswith(f"-> {choice} (TRAINFAST_JPEG=pillow|simplejpeg forces it)")
    assert "simplejpeg" in lines[0] and "Pillow" in lines[0]


def test_invalid_environment_variable_warns_and_uses_auto(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TRAINFAST_JPEG", "turbo")
    monkeypatch.setattr(decode, "_jpeg_backend", None)
    monkeypatch.setattr(decode, "_simplejpeg", None)
    with caplog.at_level(logging.INFO, logger="trainfast"):
        assert decode.jpeg_backend(64) in ("pillow", "simplejpeg")
    assert "TRAINFAST_JPEG='turbo' is not valid" in caplog.text
