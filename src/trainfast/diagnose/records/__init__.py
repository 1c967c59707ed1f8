"""The records the doctor's stages pass to each other: plain data, no hooks and no timing."""
