"""A checkpoint planted in a private Hugging Face cache under a hub id, as a download leaves it.

``huggingface_hub`` resolves ``org/name`` offline from ``HF_HOME/hub/models--org--name``: ``refs/main``
names a revision and ``snapshots/<revision>/`` holds the files (links into ``blobs/``, as a real
download writes them), so a hub id is exercised for real without the network.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

REVISION = "0123456789abcdef0123456789abcdef01234567"


def plant_in_hub_cache(checkpoint: Path, hf_home: Path, repo_id: str) -> Path:
    """Copy ``checkpoint``'s files into ``hf_home`` as hub id ``repo_id``; return the snapshot folder."""
    repository = hf_home / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot, blobs = repository / "snapshots" / REVISION, repository / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for source in sorted(checkpoint.iterdir()):
        if source.is_file():
            blob = blobs / hashlib.sha256(source.read_bytes()).hexdigest()
            shutil.copyfile(source, blob)
            (snapshot / source.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(REVISION)
    return snapshot
