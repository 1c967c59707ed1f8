

def test_tiny_images(tiny_images) -> None:
    assert len(list((tiny_images / "train").glob("*/*.jpg"))) == 80
