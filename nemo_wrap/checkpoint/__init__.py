"""Reading Hugging Face checkpoints: locating the files, validating them, reading slices."""
