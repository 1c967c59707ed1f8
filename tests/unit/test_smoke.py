import trainfast


def test_public_api() -> None:
    for name in ("make_loader", "Trainer", "TrainConfig"):
        assert hasattr(trainfast, name)


def test_tiny_images(tiny_images) -> None:
    assert len(list((tiny_images / "train").glob("*/*.jpg"))) == 80
