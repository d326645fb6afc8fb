"""A dataset's source files, for the TFDS builders here: found on this machine or downloaded.

Each builder looks for its files in the manual dir (`data.manual_dir`, else TFDS's
`<data_dir>/downloads/manual`), then in the places system packages put them, then asks TFDS to
download them. If all of that fails, one line says where it looked and how to get the files.
Images are encoded as PNG with Pillow: TFDS would otherwise call TensorFlow to encode them.
"""

import io
import os
from collections.abc import Mapping

import numpy as np
import requests

from jddp.errors import DataError


class LocalFilesBuilder:
    """Mixin for a TFDS builder whose `source_files()` are `SOURCE_FILES` ({key: file name}),
    all in one of `search_dirs`, or downloaded from `SOURCE_URLS` ({key: url}; None: manual only).

    `SYSTEM_DIRS` are where system packages install the files; `HOW_TO_GET` ends the error
    message when the files are nowhere.
    """

    SOURCE_FILES: Mapping[str, str] = {}
    SOURCE_URLS: Mapping[str, str] | None = None
    SYSTEM_DIRS: tuple[str, ...] = ()
    HOW_TO_GET: str = ""

    def __init__(self, *, manual_dir: str = "", **kwargs):
        super().__init__(**kwargs)
        self.search_dirs = [d for d in (manual_dir, *self.SYSTEM_DIRS) if d]
        # TFDS rebuilds a builder from this when its data source is pickled (loader processes).
        self._original_state = {**self._original_state, "manual_dir": manual_dir}

    def _local_files(self) -> dict[str, str] | None:
        for folder in self.search_dirs:
            paths = {key: os.path.join(folder, name) for key, name in self.SOURCE_FILES.items()}
            if all(os.path.isfile(path) for path in paths.values()):
                return paths
        return None

    def _missing(self, reason: str) -> DataError:
        where = " or ".join(self.search_dirs) or "any local folder (no manual dir given)"
        return DataError(
            f"{self.name}: {', '.join(self.SOURCE_FILES.values())} not found in {where}, "
            f"and {reason}; {self.HOW_TO_GET}"
        )

    def check_sources(self) -> None:
        """Before TFDS starts preparing: files found, or their host answers; else one error line
        at once (TFDS itself would retry an unreachable host for minutes)."""
        if self._local_files() is not None:
            return
        if not self.SOURCE_URLS:
            raise self._missing("this dataset cannot be downloaded automatically")
        url = next(iter(self.SOURCE_URLS.values()))
        try:
            requests.head(url, timeout=15, allow_redirects=True)
        except requests.RequestException as e:
            raise self._missing(f"{url} cannot be reached ({type(e).__name__})") from None

    def source_files(self, dl_manager) -> dict[str, str]:
        """Paths of `SOURCE_FILES`, found locally or downloaded by TFDS's `dl_manager`."""
        paths = self._local_files()
        if paths is not None:
            return paths
        if not self.SOURCE_URLS:
            raise self._missing("this dataset cannot be downloaded automatically")
        try:
            downloaded = dl_manager.download(dict(self.SOURCE_URLS))
        except Exception as e:  # offline, proxy, HTTP error: all end the same way
            reason = f"the download failed ({type(e).__name__}: {_first_line(e)})"
            raise self._missing(reason) from None
        return {key: os.fspath(path) for key, path in downloaded.items()}


def _first_line(error: Exception, limit: int = 160) -> str:
    line = (str(error).strip().splitlines() or [""])[0]
    return line if len(line) <= limit else line[: limit - 3] + "..."


def png_bytes(image: np.ndarray) -> bytes:
    """A uint8 (H, W, 1) or (H, W, 3) image as PNG bytes, what `tfds.features.Image` stores."""
    from PIL import Image  # only needed while preparing

    buffer = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buffer, format="PNG")
    return buffer.getvalue()
